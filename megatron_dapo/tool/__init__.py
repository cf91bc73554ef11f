"""Tools a policy calls between its turns: the interface (interface.py) and the sandboxed Python tool."""

import os
import sys

# tests/gpu/ shares the helpers in this folder.
sys.path.insert(0, os.path.dirname(__file__))

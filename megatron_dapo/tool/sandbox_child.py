"""The sandbox's first process: `python -I sandbox_child.py LIMITS_JSON`, started by tool/python_sandbox.py in the
call's scratch directory with an environment of its own. Standard library only: it runs before, and apart from,
anything of the trainer's.

It forks the model's program and waits for it. The program, before it runs a line of the model's code: gets the
resource limits (CPU seconds, address space, file size, processes, open files, no core dumps); started as root,
it joins the call's pids cgroup (root ignores the process limit) and gives up every capability; sets no_new_privs;
and, where the kernel has Landlock, may write, create and delete only beneath its scratch directory, read only the
interpreter's files, the system's and its own, connect or bind no TCP port, and signal or reach no process outside
its own. Then it execs a fresh isolated interpreter on main.py (as its standard input). This process exits with
the program's exit code, or 128 + the signal that ended it; in a PID namespace (the pool starts it under
`unshare --pid`) it is the namespace's first process, and its exit ends every process the program left behind.
"""

import ctypes
import errno
import json
import os
import resource
import sys

# Landlock's ABI (linux/landlock.h): system calls, access rights by the ABI version that brought them.
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
RULE_PATH_BENEATH = 1
CREATE_RULESET_VERSION = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_WRITES_V1 = sum(1 << b for b in range(4, 13))  # remove dir / file, make char / dir / reg / sock / fifo / block / sym
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
READS = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR


class RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi(libc) -> int:
    """The kernel's Landlock ABI version; 0 where it has none (or it is turned off)."""
    version = libc.syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION))
    return max(version, 0)


def restrict_with_landlock(libc, abi: int, scratch: str, readable: list[str]) -> None:
    writes = FS_WRITE_FILE | FS_WRITES_V1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0) \
        | (FS_IOCTL_DEV if abi >= 5 else 0)
    attr = RulesetAttr(READS | writes, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
                       SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    # ABI 1-3 know only the first field; ABI 4-5 the first two
    size = 8 if abi < 4 else 16 if abi < 6 else ctypes.sizeof(RulesetAttr)
    ruleset = libc.syscall(SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    for path, access in [(scratch, READS | writes)] + [(p, READS) for p in readable]:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a path this system does not have
        # a file (not a directory) takes only the rights a file can have
        rule = PathBeneathAttr(access if os.path.isdir(path) else access & (FS_EXECUTE | FS_READ_FILE
                                                                               | FS_WRITE_FILE), fd)
        if libc.syscall(SYS_ADD_RULE, ruleset, ctypes.c_int(RULE_PATH_BENEATH), ctypes.byref(rule),
                        ctypes.c_uint32(0)) < 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
        os.close(fd)
    if libc.syscall(SYS_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) < 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    os.close(ruleset)


def processes_of(uid: int) -> int:
    """How many processes `uid` has: the kernel's process limit counts them all, not only the sandbox's."""
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as status:
                if any(line.startswith("Uid:") and int(line.split()[1]) == uid for line in status):
                    count += 1
        except OSError:
            pass  # ended meanwhile
    return count


def drop_capabilities(libc) -> None:
    """Root keeps its uid (the interpreter may live where no other user can read) but no capability: the bounding
    set emptied, so that exec grants none back, and the process's own sets cleared."""
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
            raise OSError(ctypes.get_errno(), f"prctl(PR_CAPBSET_DROP, {cap})")
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 words: all zero
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def run_program(limits: dict) -> None:
    """In the forked child: confine this process, then exec the model's program. Never returns."""
    libc = ctypes.CDLL(None, use_errno=True)
    for name, value in (("RLIMIT_CPU", limits["cpu_s"]), ("RLIMIT_AS", limits["memory_mb"] << 20),
                        ("RLIMIT_FSIZE", limits["max_file_mb"] << 20), ("RLIMIT_NOFILE", 64), ("RLIMIT_CORE", 0)):
        # hard = soft + 1 for CPU: SIGXCPU at the soft limit, SIGKILL a second later if it is caught
        resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))
    if os.geteuid() == 0:  # root ignores RLIMIT_NPROC: its processes are counted by the call's pids cgroup
        if limits["cgroup"]:
            with open(os.path.join(limits["cgroup"], "cgroup.procs"), "w") as procs:
                procs.write(str(os.getpid()))
        drop_capabilities(libc)
    else:
        resource.setrlimit(resource.RLIMIT_NPROC, (processes_of(os.getuid()) + limits["max_processes"],) * 2)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    abi = landlock_abi(libc)
    if abi:
        restrict_with_landlock(libc, abi, os.getcwd(), limits["readable"])
    # the program read from standard input: its tracebacks say "<stdin>", not the call's random scratch path
    program = os.open("main.py", os.O_RDONLY)
    os.dup2(program, 0)
    os.close(program)
    os.execve(sys.executable, [sys.executable, "-I", "-"], dict(os.environ))


def main() -> None:
    limits = json.loads(sys.argv[1])
    pid = os.fork()
    if pid == 0:
        try:
            run_program(limits)
        except BaseException as e:  # the sandbox could not be set up: say so, in the output the pool reads
            print(f"sandbox setup failed: {type(e).__name__}: {e}", flush=True)
        os._exit(70)  # EX_SOFTWARE: the pool reports it as a setup failure, not the model's
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()

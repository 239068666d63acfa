"""Runs Python scripts as `python SCRIPT ARGS...` runs them, each in a process of its own, forked from this one after
it has imported torch, transformers and this package: a script then starts in milliseconds instead of the seconds
those imports take (tests/test_benchmarks_run.py runs every benchmark script this way).

Requests on stdin, one JSON line each: [argv, stdout file, stderr file, timeout in seconds]. The answer to each, one
line on stdout: `EXIT <status>`, the status as subprocess gives it (negative: the signal that ended the script; the
timeout sends SIGALRM). A script's process reads /dev/null, writes to the two files, and gets sys.argv and
sys.path[0] as `python SCRIPT` sets them. Nothing runs here before a fork but imports: no thread pool and no CUDA
context for the children to inherit.

    python tests/script_server.py
"""

import json
import os
import runpy
import signal
import sys

import torch  # noqa: F401  (the imports every benchmark script makes, made once here)
import transformers.modeling_utils  # noqa: F401

import hybrid_linear_models  # noqa: F401


def run_script(argv: list[str], stdout: str, stderr: str, timeout: int) -> None:
    """In the forked process: `argv` as the main program. What it raises propagates, so the interpreter ends the
    process as it ends `python SCRIPT`: a traceback or a SystemExit's message on stderr, its exit status."""
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    signal.alarm(timeout)
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")


def serve() -> None:
    for line in sys.stdin:
        argv, stdout, stderr, timeout = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_script(argv, stdout, stderr, timeout)
            sys.exit(0)  # (ends the child as the end of a script ends `python`: atexit handlers, buffers flushed)
        _, status = os.waitpid(pid, 0)
        print(f"EXIT {os.waitstatus_to_exitcode(status)}", flush=True)


if __name__ == "__main__":
    serve()

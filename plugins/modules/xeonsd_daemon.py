#!/usr/bin/python
"""Ansible module: a long-running process on a node without systemd, kept by its pid file, the way the slurm role's
direct mode keeps its daemons, with the pid file checked to be ours: the process it names must be alive and run
exactly our command (its command line ends with ``match``), so a stale file whose pid was reused by another
process is never taken for ours, and never killed.

The serve role runs ``xeonsd serve`` with it on nodes without systemd, and the serve_frontend role HAProxy.
"""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import time
import urllib.error
import urllib.request

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.xeonsd.cluster.plugins.module_utils.xeonsd_atomic import write_atomic

DOCUMENTATION = r"""
module: xeonsd_daemon
short_description: Start, stop, restart or look at a background process kept by a pid file checked to be ours
description:
  - The pid file holds the pid and C(version). A process is ours when the pid file names a live process whose
    command line holds C(match) (consecutive words, e.g. the address and port it serves on); it is current when
    the pid file also holds this C(version) (e.g. a checksum of the command and the files it serves).
  - C(status) changes nothing and returns C(running) (ours) and C(current).
  - C(started) starts C(argv) unless a current process of ours runs; an outdated one is stopped first (C(restarted)
    in the result). The process gets its own session, stdin from /dev/null, stdout and stderr appended to C(log),
    runs as C(user), and its pid goes to C(pid_file) (a temporary name renamed into place).
  - C(restarted) stops ours if it runs, then starts C(argv).
  - C(stopped) sends SIGTERM to ours, waits up to C(stop_timeout) seconds, then SIGKILL, and removes the pid file.
    A pid file that names no process of ours is removed and nothing is signalled.
  - A started process that ends within C(settle) seconds fails the task with the end of its log.
  - C(ready) changes nothing. It waits up to C(timeout) seconds until C(url) answers 200 while ours runs, and fails
    at once, with the end of its log, when ours is not running (a server that exits at start-up is named within
    C(interval) seconds, not after the whole C(timeout)).
  - Check mode says what would happen and does nothing.
options:
  argv: {description: The command and its arguments., type: list, elements: str}
  match: {description: Consecutive words of the command line that make a process ours., type: list, elements: str,
          required: true}
  version: {description: What the running process must have been started with to be current., type: str,
            default: ""}
  pid_file: {description: The pid file (its directory must exist)., type: path, required: true}
  log: {description: Where the output goes (appended)., type: path}
  user: {description: The account it runs as (default the task's)., type: str}
  chdir: {description: Its working directory (default the user's home, else /)., type: path}
  env: {description: Environment variables added to the task's., type: dict, default: {}}
  state: {description: What to make of the process (status and ready look only)., type: str, choices: [status, started, stopped, restarted, ready], default: started}
  url: {description: What answers 200 once ours is ready (state ready)., type: str}
  timeout: {description: Seconds state ready waits., type: int, default: 900}
  interval: {description: Seconds between two looks of state ready., type: float, default: 2.0}
  stop_timeout: {description: Seconds between SIGTERM and SIGKILL., type: int, default: 30}
  settle: {description: Seconds a new process must stay alive., type: float, default: 1.0}
"""


def read_pid(pid_file: str) -> tuple[int | None, str]:
    """(pid, version) of the pid file; (None, "") without one."""
    try:
        with open(pid_file) as f:
            words = f.read().split("\n", 1)
        return int(words[0].strip()), (words[1].strip() if len(words) > 1 else "")
    except (OSError, ValueError):
        return None, ""


def cmdline(pid: int) -> list[str] | None:
    """The process's argv, or None when there is no such (live) process."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    if state == "Z" or not raw:  # a zombie (or a kernel thread) is not a running daemon
        return None
    return [a.decode(errors="replace") for a in raw.rstrip(b"\0").split(b"\0")]


def ours(pid: int | None, match: list[str]) -> bool:
    """Whether ``pid`` is a live process whose command line holds the words ``match`` one after the other."""
    argv = cmdline(pid) if pid else None
    n = len(match)
    return argv is not None and any(argv[i : i + n] == match for i in range(len(argv) - n + 1))


def log_tail(path: str | None, lines: int = 15) -> str:
    if not path:
        return "(no log)"
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).strip() or "(the log is empty)"
    except OSError as e:
        return f"(no log: {e})"


def stop(pid: int, timeout: int) -> bool:
    """SIGTERM, then SIGKILL after ``timeout`` s; whether it had to be killed."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cmdline(pid) is None:
            return False
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    while cmdline(pid) is not None:
        time.sleep(0.1)
    return True


def start(module: AnsibleModule) -> int:
    p = module.params
    user = pwd.getpwnam(p["user"]) if p["user"] else None
    env = dict(os.environ, **{k: str(v) for k, v in p["env"].items()})
    if user is not None:
        env.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
    cwd = p["chdir"] or (user.pw_dir if user is not None and os.path.isdir(user.pw_dir) else "/")
    out = open(p["log"], "ab") if p["log"] else subprocess.DEVNULL  # noqa: SIM115 - handed to the child
    if p["log"] and user is not None:
        os.chown(p["log"], user.pw_uid, user.pw_gid)
    try:
        proc = subprocess.Popen(
            p["argv"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            start_new_session=True,  # not ended with the module's session
            user=user.pw_uid if user is not None else None,
            group=user.pw_gid if user is not None else None,
            extra_groups=os.getgrouplist(user.pw_name, user.pw_gid) if user is not None else None,
            close_fds=True,
        )
    except OSError as e:
        module.fail_json(msg=f"cannot start {p['argv'][0]}: {e}")
    finally:
        if out is not subprocess.DEVNULL:
            out.close()
    write_atomic(p["pid_file"], f"{proc.pid}\n{p['version']}\n".encode(), 0o644)
    try:
        rc = proc.wait(timeout=p["settle"])
    except subprocess.TimeoutExpired:
        return proc.pid
    module.fail_json(
        msg=f"{' '.join(p['argv'])} ended at once (exit {rc}); the end of {p['log'] or 'its output'}:\n"
        + log_tail(p["log"]),
        rc=rc,
    )
    return -1  # not reached


def wait_ready(module: AnsibleModule, pid: int | None) -> None:
    """state ready: exit once ``url`` answers 200, fail as soon as ours is gone or ``timeout`` has passed."""
    p = module.params
    began = time.monotonic()
    answer = "none"
    while True:
        if not ours(pid, p["match"]):
            module.fail_json(
                msg=f"{' '.join(p['match'])} is not running (it ended before it was ready, after "
                f"{time.monotonic() - began:.0f} s of waiting); the end of {p['log'] or 'its output'}:\n"
                + log_tail(p["log"]),
                status=answer,
            )
        try:
            with urllib.request.urlopen(p["url"], timeout=max(p["interval"], 1.0)) as r:
                answer = str(r.status)
        except urllib.error.HTTPError as e:
            answer = f"{e.code} {e.reason}"
        except (OSError, ValueError) as e:
            answer = str(getattr(e, "reason", e))
        if answer == "200":
            module.exit_json(changed=False, pid=pid, status=200, waited_s=round(time.monotonic() - began, 1))
        if time.monotonic() - began >= p["timeout"]:
            module.fail_json(msg=f"{p['url']} did not answer 200 within {p['timeout']} s (last answer: {answer})")
        time.sleep(p["interval"])


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "argv": {"type": "list", "elements": "str"},
            "match": {"type": "list", "elements": "str", "required": True},
            "version": {"type": "str", "default": ""},
            "pid_file": {"type": "path", "required": True},
            "log": {"type": "path"},
            "user": {"type": "str"},
            "chdir": {"type": "path"},
            "env": {"type": "dict", "default": {}},
            "state": {
                "type": "str",
                "choices": ["status", "started", "stopped", "restarted", "ready"],
                "default": "started",
            },
            "url": {"type": "str"},
            "timeout": {"type": "int", "default": 900},
            "interval": {"type": "float", "default": 2.0},
            "stop_timeout": {"type": "int", "default": 30},
            "settle": {"type": "float", "default": 1.0},
        },
        required_if=[("state", "started", ["argv"]), ("state", "restarted", ["argv"]), ("state", "ready", ["url"])],
        supports_check_mode=True,
    )
    p = module.params
    if not p["match"]:
        module.fail_json(msg="xeonsd_daemon: match must name at least one word of the command line")
    if p["user"]:
        try:
            pwd.getpwnam(p["user"])
        except KeyError:
            module.fail_json(msg=f"xeonsd_daemon: no user {p['user']} on this node")
    pid, version = read_pid(p["pid_file"])
    running = ours(pid, p["match"])
    current = running and version == p["version"]
    result = {"pid": pid if running else None, "running": running, "current": current}
    if p["state"] == "ready" and not module.check_mode:
        wait_ready(module, pid)
    if p["state"] in ("status", "ready") or (p["state"] == "started" and current):
        module.exit_json(changed=False, **result)
    if p["state"] == "stopped" and not running:
        stale = os.path.exists(p["pid_file"])
        if stale and not module.check_mode:
            os.unlink(p["pid_file"])
        module.exit_json(changed=stale, removed_stale_pid_file=stale, **result)
    if module.check_mode:
        module.exit_json(changed=True, **result)
    killed = running and stop(pid, p["stop_timeout"])
    if os.path.exists(p["pid_file"]):
        os.unlink(p["pid_file"])
    if p["state"] == "stopped":
        module.exit_json(changed=True, killed=killed, **result)
    new = start(module)
    module.exit_json(changed=True, killed=killed, restarted=running, **{**result, "pid": new, "current": True})


if __name__ == "__main__":
    main()

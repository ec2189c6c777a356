"""Generated code runs contained (hfl3.evaluate.execution.run_python): completions that delete, overwrite, loop, eat
memory, fork, signal or read secrets leave the host, its files and its processes as they were. Each case is a program
a careless model could write; the host's side is checked after each run."""

import os
import time

import pytest

from hfl3.evaluate.execution import run_python

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def host_files(tmp_path):
    """A folder of the host's with a file in it: what destructive completions aim at."""
    folder = tmp_path / "precious"
    folder.mkdir()
    (folder / "data.txt").write_text("keep me")
    return folder


DESTRUCTIVE = [
    ("rmtree", "import shutil; shutil.rmtree({folder!r})"),
    ("os.remove", "import os; os.remove({file!r})"),
    ("os.unlink via pathlib", "import pathlib; pathlib.Path({file!r}).unlink()"),
    ("overwrite with open", "open({file!r}, 'w').write('gone')"),
    ("overwrite with pathlib", "import pathlib; pathlib.Path({file!r}).write_text('gone')"),
    ("truncate with os.open", "import os; os.open({file!r}, os.O_WRONLY | os.O_TRUNC)"),
    ("rename", "import os; os.rename({file!r}, {file!r} + '.moved')"),
    ("chmod", "import os; os.chmod({folder!r}, 0)"),
    ("shell", "import os; os.system('rm -rf ' + {folder!r})"),
    ("subprocess", "import subprocess; subprocess.run(['rm', '-rf', {folder!r}])"),
    ("kill the parent", "import os; os.kill({parent}, 9)"),
    ("fork", "import os; os.fork()"),
]


@pytest.mark.parametrize("name,template", DESTRUCTIVE, ids=[case[0] for case in DESTRUCTIVE])
def test_destructive_completions_leave_the_host_untouched(host_files, name, template):
    program = template.format(folder=str(host_files), file=str(host_files / "data.txt"), parent=os.getpid())
    result = run_python(program)
    assert not result.success and "PermissionError" in result.error, (name, result.stderr[-500:])
    assert sorted(p.name for p in host_files.iterdir()) == ["data.txt"]
    assert (host_files / "data.txt").read_text() == "keep me" and os.access(host_files, os.W_OK)


def test_the_working_directory_is_its_own_and_temporary():
    result = run_python("import os, pathlib\npathlib.Path('out.txt').write_text('mine')\n"
                        "print(os.getcwd()); print(open('out.txt').read()); print(sorted(os.environ))")
    workdir, content, environment = result.stdout.splitlines()
    assert result.success and content == "mine"
    assert not os.path.exists(workdir)  # deleted afterwards
    assert environment == str(["HOME", "LANG", "OMP_NUM_THREADS", "PATH", "TMPDIR"])  # nothing of ours


def test_secrets_in_the_environment_are_not_seen(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    result = run_python("import os; print(os.environ.get('HF_TOKEN'))")
    assert result.success and result.stdout.strip() == "None"


def test_a_loop_is_killed_at_the_time_limit():
    started = time.perf_counter()
    result = run_python("while True:\n    pass", timeout=1.0)
    assert result.timeout and not result.success and result.returncode is None
    assert time.perf_counter() - started < 10


def test_memory_is_limited():
    result = run_python("blocks = [bytearray(64 * 2**20) for _ in range(64)]  # 4 GiB", max_memory_bytes=256 * 2**20)
    assert not result.success and result.memory_exceeded
    assert run_python("x = bytearray(32 * 2**20); print(len(x))").success  # below the limit it runs


def test_output_is_capped_and_nothing_outlives_the_program():
    result = run_python("while True:\n    print('x' * 4096)", timeout=5.0)
    assert not result.success and len(result.stdout) <= 64 * 1024  # the file limit stops it, the parent reads 64 KiB
    # a child started around the guards (posix.fork is not guarded) is killed with the program's process group
    result = run_python("import posix, time\npid = posix.fork()\nif pid == 0:\n    time.sleep(60)\n"
                        "print(pid, flush=True)")
    child = int(result.stdout.split()[0])
    time.sleep(0.2)
    assert process_state(child) in (None, "Z")  # gone, or dead and waiting for init to reap it


def process_state(pid: int) -> str | None:
    """The state letter of process `pid` in /proc (R, S, Z, ...), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None

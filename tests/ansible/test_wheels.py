"""roles/ml_stack's wheels.yml on this machine (ansible-playbook, local connection), with pip's --no-index and local
files only: the Diffusers wheel (a tiny sdist named diffusers stands in for it, built from a local "index", a
staged archive or a local git repository) and the xeonsd wheel (from a copy of this repository's train/) are built
once on the "controller" and put on a "node" directory; a second run and --check change nothing; a changed source
gives a new wheel (a new <name>-<id>/ directory) and leaves the other wheel alone."""

from __future__ import annotations

import getpass
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from repo_code import REPO, changed, local_playbook

PLAY = """
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: xeonsd.cluster.ml_stack
        tasks_from: wheels
    - ansible.builtin.copy:
        dest: "{{ cache }}/wheelhouse_wheels_built.json"
        content: "{{ wheelhouse_wheels_built | to_json }}"
        mode: "0644"
      check_mode: false
      changed_when: false
"""


def play(site: dict, *args: str, **overrides: object) -> subprocess.CompletedProcess:
    return local_playbook(site["play"], site["vars"] | overrides, *args, timeout=600)


def run(site: dict, *args: str, **overrides: object) -> tuple[int, dict, str]:
    result = play(site, *args, **overrides)
    n = changed(result)
    return n, json.loads((site["cache"] / "wheelhouse_wheels_built.json").read_text()), result.stdout


def installed_wheel(dist_name: str, dest: Path) -> Path:
    """A wheel of the installed distribution ``dist_name`` (its files as its RECORD lists them), so the builder
    venv gets the real build backend without an index."""
    dist = importlib.metadata.distribution(dist_name)
    meta = dist.metadata
    files = [f for f in dist.files if f.parts[0] != ".." and "__pycache__" not in f.parts and f.name != "RECORD"]
    info = next(f.parts[0] for f in files if f.parts[0].endswith(".dist-info"))
    path = dest / f"{meta['Name']}-{meta['Version']}-py3-none-any.whl"
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for f in files:
            z.write(dist.locate_file(f), str(f))
        z.writestr(f"{info}/RECORD", "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n")
    return path


def tiny_diffusers(root: Path, version: str) -> Path:
    """A source tree of a distribution named diffusers (setuptools, one module) at ``version``."""
    (root / "src" / "diffusers").mkdir(parents=True)
    (root / "src" / "diffusers" / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (root / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "diffusers"\nversion = "{version}"\n[tool.setuptools.packages.find]\nwhere = ["src"]\n'
    )
    return root


def sdist(tree: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{tree.name}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        tar.add(tree, arcname=tree.name)
    return path


@pytest.fixture
def site(tmp_path: Path) -> dict:
    setuptools = importlib.metadata.version("setuptools")
    index = tmp_path / "index"
    installed_wheel("setuptools", index)
    sdist(tiny_diffusers(tmp_path / "src" / "diffusers-0.0.1", "0.0.1"), index)
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("# the stack's pins\ndiffusers == 0.0.1  # the sdist in the index\n")
    train = tmp_path / "xeonsd-source" / "train"
    shutil.copytree(REPO / "train", train, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build", ".*"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "play.yml").write_text(PLAY)
    return {
        "play": tmp_path / "play.yml",
        "cache": tmp_path / "cache",
        "node": tmp_path / "node",
        "vars": {
            "cache": str(tmp_path / "cache"),
            "ansible_python_interpreter": sys.executable,
            "wheelhouse_python": sys.executable,
            "wheelhouse_owner": getpass.getuser(),
            "ml_stack_requirements": str(requirements),
            "ml_stack_diffusers_source": "sdist",
            "ml_stack_diffusers_source_archive": "",
            "ml_stack_diffusers_source_archive_sha256": "",
            "ml_stack_diffusers_git_url": "",
            "ml_stack_diffusers_git_ref": "",
            "ml_stack_build_requirements": [f"setuptools=={setuptools}"],
            "ml_stack_xeonsd_source": str(train),
            "ml_stack_xeonsd_tar": str(tmp_path / "cache" / "xeonsd-src.tar"),
            "wheelhouse_builder_pip_args": ["--no-index", "--find-links", str(index)],
            "wheelhouse_wheels_controller_dir": str(tmp_path / "cache" / "wheels"),
            "wheelhouse_wheels_node_dir": str(tmp_path / "node"),
        },
        "tmp": tmp_path,
        "train": train,
    }


def built(stdout: str) -> list[str]:
    """The wheels this run built (the pip wheel task ran, not skipped)."""
    names = []
    for part in stdout.split("TASK [xeonsd.cluster.wheelhouse : Build the wheel - ")[1:]:
        name, body = part.split("]", 1)
        if "changed: [localhost" in body.split("TASK [")[0]:
            names.append(name)
    return names


def wheel_metadata(path: Path) -> dict[str, str]:
    with zipfile.ZipFile(path) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(meta).decode().splitlines()
    return dict(line.split(": ", 1) for line in lines if ": " in line and line.split(": ")[0] in ("Name", "Version"))


def test_wheels_are_built_once_each_from_a_changed_source_a_staged_archive_or_a_git_ref(site: dict) -> None:
    """One controller cache through five runs, each building only what changed: both wheels from the sdist; a
    changed xeonsd source, the xeonsd wheel alone; the Diffusers source switched to a staged archive, then to a git
    ref, the Diffusers wheel alone; a wrong archive checksum stops the run before anything is built. (That a second
    run with the same sources changes nothing: the offline install test below, and provision.yml on the cluster.)"""
    cache, tmp = site["cache"], site["tmp"]
    n, wheels, out = run(site)
    assert n > 0 and built(out) == ["diffusers", "xeonsd"], out[-3000:]
    assert sorted(wheels) == ["diffusers", "xeonsd"]
    # The controller: <name>-<id>/<pip's wheel file>, marked complete with the source's key.
    diffusers, xeonsd = wheels["diffusers"], wheels["xeonsd"]
    assert diffusers["key"] == "sdist diffusers==0.0.1" and diffusers["file"] == "diffusers-0.0.1-py3-none-any.whl"
    assert Path(diffusers["controller"]) == cache / "wheels" / f"diffusers-{diffusers['id']}" / diffusers["file"]
    assert (cache / "wheels" / f"diffusers-{diffusers['id']}" / ".complete").read_text() == diffusers["key"] + "\n"
    tar_sha1 = hashlib.sha1((cache / "xeonsd-src.tar").read_bytes()).hexdigest()
    assert xeonsd["key"] == f"source sha1 {tar_sha1}" and xeonsd["file"].startswith("xeonsd-")
    assert wheel_metadata(Path(xeonsd["controller"]))["Name"] == "xeonsd"
    assert wheel_metadata(Path(diffusers["controller"])) == {"Name": "diffusers", "Version": "0.0.1"}
    # The node: one tree named after its content, holding exactly the controller's wheels, byte for byte.
    for w in wheels.values():
        assert Path(w["node"]).read_bytes() == Path(w["controller"]).read_bytes()
    (tree,) = site["node"].iterdir()
    assert sorted(str(p.relative_to(tree)) for p in tree.rglob("*.whl")) == sorted(
        f"{name}-{w['id']}/{w['file']}" for name, w in wheels.items()
    )
    # The train/ copy is packed, never built in place.
    assert not list(site["train"].rglob("*.egg-info")) and not (site["train"] / "build").exists()

    # A changed xeonsd source: a new xeonsd wheel (new id), the Diffusers wheel left as it is.
    (site["train"] / "src" / "xeonsd" / "__init__.py").write_text(
        (site["train"] / "src" / "xeonsd" / "__init__.py").read_text() + "# changed\n"
    )
    n, changed_source, out = run(site)
    assert n > 0 and built(out) == ["xeonsd"], out[-3000:]
    # The same Diffusers wheel, in the node's new tree (named after the content of both).
    assert {k: v for k, v in changed_source["diffusers"].items() if k != "node"} == {
        k: v for k, v in diffusers.items() if k != "node"
    }
    assert Path(changed_source["diffusers"]["node"]).read_bytes() == Path(diffusers["controller"]).read_bytes()
    assert changed_source["xeonsd"]["id"] != xeonsd["id"] and Path(changed_source["xeonsd"]["node"]).is_file()
    assert Path(xeonsd["controller"]).is_file()  # the old build stays: going back needs no rebuild

    # The Diffusers source a staged archive (a git ref's source, checked by its sha256): that wheel alone is built.
    archive = sdist(tiny_diffusers(tmp / "staged" / "diffusers-0.0.2", "0.0.2"), tmp / "staged")
    sha256 = hashlib.sha256(archive.read_bytes()).hexdigest()
    staged = {
        "ml_stack_diffusers_source": "git",
        "ml_stack_diffusers_source_archive": str(archive),
        "ml_stack_diffusers_source_archive_sha256": sha256,
        "ml_stack_diffusers_git_ref": "v0.0.2",
    }
    n, wheels, out = run(site, **staged)
    assert n > 0 and built(out) == ["diffusers"], out[-3000:]
    assert wheels["diffusers"]["key"] == f"archive sha256 {sha256}"
    assert wheels["diffusers"]["file"] == "diffusers-0.0.2-py3-none-any.whl"
    assert wheels["xeonsd"]["id"] == changed_source["xeonsd"]["id"]  # kept, not rebuilt
    # The same archive again: nothing is built or changed (its key, the archive's sha256, is the wheel's).
    n, again, out = run(site, **staged)
    assert n == 0 and built(out) == [] and again["diffusers"] == wheels["diffusers"], out[-3000:]
    # A wrong sha256 stops the run on the controller before anything is built.
    result = play(site, **staged | {"ml_stack_diffusers_source_archive_sha256": "0" * 64})
    assert result.returncode != 0 and f"{archive} (Diffusers v0.0.2 source archive) on the controller" in result.stdout
    assert "Build the wheel - diffusers" not in result.stdout

    # A git repository at a tag (file://: pip clones it as it would GitHub).
    repo = tiny_diffusers(tmp / "git" / "diffusers", "0.0.3")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "0.0.3"], check=True)
    subprocess.run([*git, "tag", "v0.0.3"], check=True)
    from_git = {
        "ml_stack_diffusers_source": "git",
        "ml_stack_diffusers_git_url": f"file://{repo}",
        "ml_stack_diffusers_git_ref": "v0.0.3",
    }
    n, wheels, out = run(site, **from_git)
    assert n > 0 and built(out) == ["diffusers"], out[-3000:]
    assert wheels["diffusers"]["key"] == f"git file://{repo}@v0.0.3"
    assert wheel_metadata(Path(wheels["diffusers"]["controller"]))["Version"] == "0.0.3"


STACK_PLAY = """
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.include_role:
        name: xeonsd.cluster.ml_stack
"""


@pytest.mark.parametrize("offline", [True, False], ids=["offline", "online"])
def test_the_node_installs_the_controller_wheels_once(site: dict, offline: bool) -> None:
    """The whole ml_stack role, the "node" a venv on this machine, its "index" the local one (PIP_NO_INDEX,
    PIP_FIND_LINKS): online and offline alike the env gets Diffusers and xeonsd from the controller's wheels, once;
    offline the wheelhouse is downloaded with the controller's Diffusers wheel named as a file."""
    tmp = site["tmp"]
    tiny = tmp / "index" / "tinynodeps-1.0-py3-none-any.whl"
    with zipfile.ZipFile(tiny, "w") as z:
        z.writestr("tinynodeps/__init__.py", "")
        z.writestr("tinynodeps-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tinynodeps\nVersion: 1.0\n")
        z.writestr("tinynodeps-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("tinynodeps-1.0.dist-info/RECORD", "")
    nodeps = tmp / "requirements-nodeps.txt"
    nodeps.write_text("tinynodeps==1.0\n")
    env = tmp / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(env / "bin" / "python"),
            "install",
            "--quiet",
            "--no-index",
            str(installed_wheel("pip", tmp / "pip")),
        ],
        check=True,
    )
    (tmp / "stack.yml").write_text(STACK_PLAY)
    stack = {
        "play": tmp / "stack.yml",
        "vars": site["vars"]
        | {
            "ml_stack_name": "stock",
            "ml_stack_env_prefix": str(env),
            "ml_stack_nodeps_requirements": str(nodeps),
            "ml_stack_extra_index_urls": [],
            "ml_stack_seed_packages": [],
            "ml_stack_seed_excluded": [],
            "ml_stack_seed_index_urls": [],
            "ml_stack_offline": offline,
            "ml_stack_node_dir": str(tmp / "node-cache"),
            "ml_stack_verify": False,
            "wheelhouse_controller_dir": str(site["cache"] / "wheelhouse"),
            "wheelhouse_node_dir": str(tmp / "node-wheelhouse"),
        },
    }
    os.environ["PIP_NO_INDEX"], os.environ["PIP_FIND_LINKS"] = "1", str(tmp / "index")
    try:
        first = play(stack)
        assert changed(first) > 0
        if not offline:  # the second run and check mode are the offline case's (the same tasks, a minute each)
            check_installed(env, tmp, offline)
            return
        again = play(stack)
        assert changed(again) == 0 and built(again.stdout) == [], again.stdout[-4000:]
        # --check runs through and touches no wheel. The pip module's own check mode reports what it cannot compare
        # (requirement files, and setuptools, which pip freeze leaves out) as changed: those tasks alone change.
        check = play(stack, "--check")
        assert changed(check) >= 0
        tasks = [t.split("]")[0] for t in check.stdout.split("TASK [")[1:] if "\nchanged: [" in t]
        assert set(tasks) <= {
            "xeonsd.cluster.ml_stack : Install the build backend",
            "xeonsd.cluster.ml_stack : Install requirements.txt",
            "xeonsd.cluster.ml_stack : Install the packages that need --no-deps",
        }, tasks
    finally:
        del os.environ["PIP_NO_INDEX"], os.environ["PIP_FIND_LINKS"]
    check_installed(env, tmp, offline)
    # The wheelhouse holds the controller's Diffusers wheel (copied by pip download), and no other Diffusers.
    (wheelhouse,) = (tmp / "node-wheelhouse").iterdir()
    assert sorted(p.name for p in wheelhouse.glob("diffusers*")) == ["diffusers-0.0.1-py3-none-any.whl"]
    (wheel,) = (site["cache"] / "wheels").glob("diffusers-*/diffusers-0.0.1-py3-none-any.whl")
    assert (wheelhouse / wheel.name).read_bytes() == wheel.read_bytes()


def check_installed(env: Path, tmp: Path, offline: bool) -> None:
    """The env imports the controller's Diffusers wheel and xeonsd, each marked once; online, no wheelhouse."""
    out = subprocess.run(
        [
            str(env / "bin" / "python"),
            "-c",
            "import diffusers, xeonsd, tinynodeps; print(diffusers.__version__, xeonsd.__version__)",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert out[0] == "0.0.1"
    markers = sorted(p.name.split("-")[0] for p in env.glob(".*-*"))
    assert markers == [".diffusers", ".xeonsd"], markers
    assert (tmp / "node-wheelhouse").exists() == offline

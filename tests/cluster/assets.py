"""What the test cluster's playbooks stage on the nodes, made on the controller: stand-ins for the dicoo images and
the base model (with the xeonsd CLI), and a snapshot of train/ (the package the nodes get)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from cluster_inventory import REPO
from host import run

VENV_BIN = Path(sys.executable).parent


def make_assets(assets_dir: Path, xeonsd_source: Path) -> None:
    """The images with captions at <assets_dir>/dicoo and the tiny model at <assets_dir>/tiny-sd (each made once),
    and a fresh copy of train/ at `xeonsd_source`, so that edits in the working tree during a test session do not
    count as changes between two runs."""
    if xeonsd_source.exists():
        shutil.rmtree(xeonsd_source)
    shutil.copytree(
        REPO / "train",
        xeonsd_source,
        ignore=shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build", "*.pyc"),
    )
    xeonsd = str(VENV_BIN / "xeonsd")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    # The images come with captions (metadata.jsonl): the dataset role stages them, every method trains on them.
    if not (assets_dir / "dicoo" / "metadata.jsonl").exists():
        shutil.rmtree(assets_dir / "dicoo", ignore_errors=True)
        shutil.rmtree(assets_dir / "dicoo.partial", ignore_errors=True)
        run([xeonsd, "make-dataset", str(assets_dir / "dicoo.partial"), "--captions", "metadata"], env=env)
        (assets_dir / "dicoo.partial").rename(assets_dir / "dicoo")
    if not (assets_dir / "tiny-sd").exists():
        run([xeonsd, "make-tiny-model", str(assets_dir / "tiny-sd.partial")], env=env)
        (assets_dir / "tiny-sd.partial").rename(assets_dir / "tiny-sd")


def make_tiny_flux(assets_dir: Path) -> Path:
    """The tiny FLUX.1-dev pipeline at <assets_dir>/tiny-flux (made once): the flow-matching base model that the FLUX
    test stages next to tiny-sd."""
    return _make_tiny(assets_dir, "tiny-flux")


def _make_tiny(assets_dir: Path, arch: str) -> Path:
    """``make-tiny-model --arch ARCH`` at <assets_dir>/ARCH, once (built under a .partial name, renamed when done)."""
    out = assets_dir / arch
    if not out.exists():
        shutil.rmtree(assets_dir / f"{arch}.partial", ignore_errors=True)
        run([str(VENV_BIN / "xeonsd"), "make-tiny-model", str(assets_dir / f"{arch}.partial"), "--arch", arch])
        (assets_dir / f"{arch}.partial").rename(out)
    return out


MANY_IMAGES = 1000


def make_many_images(assets_dir: Path) -> Path:
    """A real data set's size: MANY_IMAGES tiny captioned images of mixed sizes and aspect ratios at
    <assets_dir>/many (made once), `xeonsd make-dataset --count 1000 --sizes mixed` as a user would."""
    out = assets_dir / "many"
    if not (out / "metadata.jsonl").exists():
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(assets_dir / "many.partial", ignore_errors=True)
        xeonsd = str(VENV_BIN / "xeonsd")
        argv = [xeonsd, "make-dataset", str(assets_dir / "many.partial"), "--count", str(MANY_IMAGES)]
        run([*argv, "--sizes", "mixed", "--captions", "metadata"], env=dict(os.environ, HF_HUB_OFFLINE="1"))
        (assets_dir / "many.partial").rename(out)
    return out


PAIRS_PROMPT = "turn the red square blue"


def make_pairs(assets_dir: Path, n: int = 5) -> Path:
    """Image pairs for edit training at <assets_dir>/pairs (made once, ``xeonsd make-dataset --pairs``): ``n`` 64 px
    images of a blue square, each with its reference (the same square red) in ref/, named by metadata.jsonl's
    ``cond_image`` beside the caption."""
    from xeonsd.assets import make_pairs as write_pairs

    out = assets_dir / "pairs"
    if not (out / "metadata.jsonl").exists():
        shutil.rmtree(out, ignore_errors=True)
        write_pairs(out, n, prompt=PAIRS_PROMPT)
    return out

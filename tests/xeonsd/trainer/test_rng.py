"""The random streams: one registry (xeonsd.trainer.rng.Stream), each stream drawn by one user, no bare numbers.

Two draws on one stream are correlated: until the registry, example k's caption dropout and tag order came from
the same generator as epoch k's bucket batch order (both stream 5). These tests read every use in the package's
source, so a new draw that reuses a stream, or passes a number instead of a member, fails here with its line."""

from __future__ import annotations

import ast
from collections import defaultdict

import pytest
import torch
from repo_code import REPO

from xeonsd.trainer.rng import CLASS_IMAGE_SEED, Stream, generator, stream_seed

PKG = REPO / "train" / "src" / "xeonsd"
RNG = PKG / "trainer" / "rng.py"


def _users() -> dict[Stream, set[str]]:
    """Each stream's users: the top-level class or function (``path::name``) whose code names ``Stream.X``."""
    users: dict[Stream, set[str]] = defaultdict(set)
    for path in sorted(PKG.rglob("*.py")):
        if path == RNG:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for top in tree.body:
            name = getattr(top, "name", "<module>")
            for node in ast.walk(top):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "Stream"
                    and node.attr in Stream.__members__
                ):
                    users[Stream[node.attr]].add(f"{path.relative_to(PKG)}::{name}")
    return users


def test_every_stream_has_exactly_one_user() -> None:
    users = _users()
    shared = {s.name: sorted(u) for s, u in users.items() if len(u) > 1}
    assert not shared, f"streams drawn by more than one user (give each its own Stream member): {shared}"
    unused = [s.name for s in Stream if s not in users]
    assert not unused, f"registered streams nobody draws (remove them or draw them): {unused}"


def test_no_draw_names_its_stream_by_a_bare_number() -> None:
    """Every ``generator``/``stream_seed`` call passes a Stream member; ``mix`` only seeds the class images."""
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if path == RNG:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            where = f"{path.relative_to(REPO)}:{node.lineno}"
            if node.func.id in ("generator", "stream_seed") and len(node.args) >= 2:
                stream = node.args[1]
                if not (isinstance(stream, ast.Attribute) and getattr(stream.value, "id", None) == "Stream"):
                    bad.append(f"{where}: {node.func.id}(…, {ast.unparse(stream)}, …)")
            elif node.func.id == "mix" and ast.unparse(node.args[0]) != "CLASS_IMAGE_SEED":
                bad.append(f"{where}: mix({ast.unparse(node.args[0])}, …)")
    assert not bad, "draws outside the registry:\n" + "\n".join(bad)


def test_a_bare_number_is_refused_at_run_time() -> None:
    with pytest.raises(TypeError, match="Stream member"):
        generator(1, 5, 0)
    with pytest.raises(TypeError, match="Stream member"):
        stream_seed(1, 2)


def test_the_caption_draws_and_the_bucket_batch_order_are_independent_now() -> None:
    """The collision this registry ended: caption draws of example k and the batch order of epoch k."""
    captions = torch.rand(8, generator=generator(42, Stream.CAPTIONS, 3))
    batches = torch.rand(8, generator=generator(42, Stream.BUCKET_BATCHES, 3))
    assert not torch.equal(captions, batches)


def test_the_class_images_seed_is_not_the_runs() -> None:
    assert CLASS_IMAGE_SEED not in {int(s) for s in Stream}

"""Where a model comes from: a local pipeline directory, the Hub, or the Hub cache; and one line when none will do.

No test here needs the network: the unreachable Hub is the host name ``hub.invalid`` (RFC 6761 names never
resolve), the reachable one is ``localhost``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from xeonsd.modelfiles.modelsource import ModelSourceError, check_model_source, looks_like_hub_id

UNREACHABLE = "https://hub.invalid"
FIXES = ("give the path of a local diffusers pipeline directory", "base_model role")


def _cached(cache: Path, repo: str, commit: str = "a" * 40) -> Path:
    """The Hub cache's layout for a model whose ``main`` is ``commit``, holding only model_index.json."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "model_index.json").write_text("{}")
    return cache


def _error(model: str, **kwargs) -> str:
    with pytest.raises(ModelSourceError) as info:
        check_model_source(model, **kwargs)
    message = str(info.value)
    assert "\n" not in message, "the error must be one line"
    return message


def test_a_pipeline_directory_is_taken_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "model_index.json").write_text("{}")
    source = check_model_source(str(tmp_path), offline=True, endpoint=UNREACHABLE)
    assert source.kind == "local" and str(tmp_path) in source.detail


def test_a_directory_without_model_index_is_named(tmp_path: Path) -> None:
    (tmp_path / "unet").mkdir()
    message = _error(str(tmp_path))
    assert f"--pretrained_model_name_or_path {tmp_path}:" in message and "no model_index.json" in message


@pytest.mark.parametrize("model", ["./nope", "/no/such/model", "nope", "a/b/c", "~/models/sd", "bad id/x"])
def test_a_path_that_does_not_exist_and_is_no_hub_id_fails_at_once(model: str) -> None:
    message = _error(model, endpoint="http://localhost")  # a reachable Hub is not even asked
    assert message.startswith(f"--pretrained_model_name_or_path {model}: ")
    assert "looked for as a local directory (not found)" in message and "a Hub id reads 'owner/name'" in message
    assert all(fix in message for fix in FIXES) and "HF_HUB_OFFLINE=1" in message


def test_a_hub_id_whose_host_does_not_resolve_fails_at_once(tmp_path: Path) -> None:
    message = _error("nope/dir", offline=False, endpoint=UNREACHABLE, cache_dir=tmp_path, flag="source")
    assert message.startswith("source nope/dir: cannot be loaded: looked for as a local directory (not found)")
    assert "on the Hub (host hub.invalid does not resolve)" in message
    assert all(fix in message for fix in FIXES) and "on nodes without network set HF_HUB_OFFLINE=1" in message


def test_an_unresolvable_hub_with_the_model_in_the_cache_points_to_offline_mode(tmp_path: Path) -> None:
    cache = _cached(tmp_path, "owner/sd")
    message = _error("owner/sd", offline=False, endpoint=UNREACHABLE, cache_dir=cache)
    assert "host hub.invalid does not resolve; the Hub cache has a copy, which HF_HUB_OFFLINE=1 loads" in message


def test_offline_a_hub_id_is_taken_from_the_cache_at_its_revision(tmp_path: Path) -> None:
    cache = _cached(tmp_path, "owner/sd")
    source = check_model_source("owner/sd", offline=True, endpoint=UNREACHABLE, cache_dir=cache)
    assert source.kind == "hub-cache"
    message = _error("owner/sd", revision="v2", offline=True, endpoint=UNREACHABLE, cache_dir=cache)
    assert f"offline: HF_HUB_OFFLINE=1, and the Hub cache {cache} has no copy at revision v2" in message
    message = _error("owner/other", offline=True, cache_dir=cache)
    assert "owner/other" in message and "download it into the Hub cache where there is network" in message


def test_a_hub_id_goes_on_when_the_hub_host_resolves(tmp_path: Path) -> None:
    source = check_model_source("owner/sd", offline=False, endpoint="http://localhost:8080", cache_dir=tmp_path)
    assert source.kind == "hub" and "localhost resolves" in source.detail


def test_a_local_only_command_does_not_take_a_hub_id(tmp_path: Path) -> None:
    message = _error("owner/sd", flag="--model", hub=False, offline=False, endpoint="http://localhost")
    assert message.startswith("--model owner/sd: ") and "local directory only" in message


@pytest.mark.parametrize(
    ("model", "hub"),
    [
        ("stable-diffusion-v1-5/stable-diffusion-v1-5", True),
        ("owner/name.v2", True),
        ("nope/dir", True),
        ("./owner/name", False),
        ("/owner/name", False),
        ("owner", False),
        ("a/b/c", False),
        ("own er/x", False),
        ("owner/na--me", False),
    ],
)
def test_hub_ids_are_owner_slash_name(model: str, hub: bool) -> None:
    assert looks_like_hub_id(model) is hub

"""``xeonsd serve --embeds`` over real HTTP: a textual inversion concept served on the base model's export (the tiny
SD export, static batch 5 at 64 px), with a LoRA adapter beside it, through the ``openai`` client. One server, shared
by the module's tests in file order (the last one stops it with SIGTERM).

The concept goes into an overlay of the export that every worker compiles from (GenAI takes no embeddings per
request), so the concept's token gives the image ``xeonsd generate --embeds`` gives, on the base and under the
adapter; ``/v1/models`` names the token; and the overlay is gone once the server stops. Images are compared as uint8
pixels: "mean" is the mean absolute difference over all pixels.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from ov_assets import PROMPT, TOKEN
from serve_process import ServeProcess

pytestmark = pytest.mark.xdist_group("xeonsd-serve")  # beside test_serve_api.py: the export and adapter made once

SIZE = 64
PER_CALL = 5
STEPS = 3
SEED = 5
INITIALIZER = PROMPT.replace(TOKEN, "toy")  # the same prompt with a word the tokenizer knows


@pytest.fixture(scope="module")
def tmpdir_env(cli_env_module: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The server's environment with its own TMPDIR, where it writes the overlay."""
    return {**cli_env_module, "TMPDIR": str(tmp_path_factory.mktemp("serve-tmp"))}


@pytest.fixture(scope="module")
def server(ov_base: Path, embeds: Path, toy_adapter: Path, tmpdir_env: dict[str, str]) -> Iterator[ServeProcess]:
    with ServeProcess.running(
        ov_base,
        "--name=concept",
        f"--embeds={embeds}",
        f"--adapter=toy={toy_adapter}",
        "--workers=1",
        f"--max-images={PER_CALL}",
        env=tmpdir_env,
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServeProcess):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v3", api_key="unused", max_retries=0)


def _served(client, prompt: str, model: str = "concept") -> np.ndarray:
    from PIL import Image

    result = client.images.generate(
        model=model,
        prompt=prompt,
        n=1,
        size=f"{SIZE}x{SIZE}",
        extra_body={"rng_seed": SEED, "num_inference_steps": STEPS},
    )
    png = base64.b64decode(result.data[0].b64_json)
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64)


def _generated(ov_base: Path, embeds: Path, loras: tuple = ()) -> np.ndarray:
    """The first image of ``xeonsd generate --engine genai --embeds`` (and ``--lora``) at the same seed: the call the
    server makes for a request of one image."""
    from ov_assets import as_array

    from xeonsd.openvino.generate import GenerateOptions, generate

    opts = GenerateOptions(
        prompts=(PROMPT,), num_images=PER_CALL, steps=STEPS, seed=SEED, engine="genai", embeds=embeds, loras=loras
    )
    return as_array(generate(ov_base, opts)[0])[0]


def test_models_name_the_concept_token(client, server: ServeProcess) -> None:
    """Every served model holds the concept (its pipelines compile from the overlay): each row says so, with the
    token a prompt names (not the <dicoo>_1 the server adds after it), and the start-up log names the overlay."""
    models = client.models.list().data
    assert [m.id for m in models] == ["concept", "toy"]
    assert all(m.model_extra["concept_tokens"] == [TOKEN] for m in models), [m.model_extra for m in models]
    assert any("concept tokens: <dicoo>, <dicoo>_1" in line for line in server.lines), server.lines


def test_the_concept_token_gives_the_image_generate_embeds_gives(client, ov_base: Path, embeds: Path) -> None:
    """Same seed: the concept's token gives xeonsd generate --embeds' image, not the initializer word's."""
    concept = _served(client, PROMPT)
    assert np.abs(concept - _served(client, INITIALIZER)).mean() > 2.0  # 5.4 measured; one seed and prompt: 0
    diff = np.abs(concept - _generated(ov_base, embeds))
    assert diff.max() <= 2.0, (diff.mean(), diff.max())


def test_an_adapter_applies_on_top_of_the_concept(client, ov_base: Path, embeds: Path, toy_adapter: Path) -> None:
    """GenAI applies a LoRA adapter on the overlay's pipelines: model toy with the token gives generate --embeds
    --lora's image, unlike the base with the token or toy with the initializer word."""
    toy = _served(client, PROMPT, "toy")
    assert np.abs(toy - _served(client, PROMPT)).mean() > 2.0
    assert np.abs(toy - _served(client, INITIALIZER, "toy")).mean() > 2.0
    diff = np.abs(toy - _generated(ov_base, embeds, ((toy_adapter, 1.0),)))
    assert diff.max() <= 2.0, (diff.mean(), diff.max())


def test_the_overlay_holds_the_text_side_only_and_is_removed_on_shutdown(
    server: ServeProcess, tmpdir_env: dict[str, str]
) -> None:
    """The overlay has its own text encoder and tokenizer and links the rest (the UNet is not copied); SIGTERM ends
    the server with 0 and leaves nothing in its TMPDIR."""
    tmp = Path(tmpdir_env["TMPDIR"])
    (overlay,) = tmp.glob("xeonsd-serve-*/models")
    assert (overlay / "text_encoder" / "openvino_model.xml").is_file() and not (overlay / "text_encoder").is_symlink()
    assert (overlay / "tokenizer" / "openvino_tokenizer.xml").is_file()
    assert (overlay / "unet").is_symlink() and (overlay / "vae_decoder").is_symlink()
    assert server.stop() == 0
    assert list(tmp.iterdir()) == []

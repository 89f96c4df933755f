"""Model families told apart from their config files: SD 1.x/2.x, SDXL, FLUX.1 and SD3 served, the others refused in
one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xeonsd.families import FamilyError, detect_family


def _pipeline(
    tmp_path: Path, index: dict, unet: dict | None = None, vae: dict | None = None, transformer: dict | None = None
) -> Path:
    """A pipeline directory with only its config files (detection must not need any weights)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "model_index.json").write_text(json.dumps(index))
    for sub, cfg in (("unet", unet), ("vae", vae), ("transformer", transformer)):
        if cfg is not None:
            (d / sub).mkdir()
            (d / sub / "config.json").write_text(json.dumps(cfg))
    return d


C = ["diffusers", "X"]
SDXL_INDEX = {
    "_class_name": "StableDiffusionXLPipeline",
    **{k: C for k in ("vae", "unet", "scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")},
}
VAE = {"block_out_channels": [128, 256, 512, 512]}


def test_the_tiny_pipelines_are_told_apart(tiny_model: Path, tiny_xl_model: Path) -> None:
    sd = detect_family(tiny_model)
    assert (sd.name, sd.text_encoders, sd.pipeline_class) == ("sd", ("text_encoder",), "StableDiffusionPipeline")
    assert sd.default_resolution == 64  # sample_size 8 × VAE scale 8
    xl = detect_family(tiny_xl_model)
    assert (xl.name, xl.spec.concept_layout, xl.label) == ("sdxl", "xl", "SDXL")
    assert xl.text_encoders == ("text_encoder", "text_encoder_2")
    assert xl.tokenizers == ("tokenizer", "tokenizer_2")


def test_the_tiny_xl_pipeline_runs_in_stock_diffusers(tiny_xl_model: Path) -> None:
    import torch
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_xl_model)
    assert pipe.unet.config.addition_embed_type == "text_time"
    assert pipe.unet.config.cross_attention_dim == 64  # 32 + 32: both encoders' hidden states, concatenated
    assert pipe.text_encoder_2.config.projection_dim == 32
    out = pipe("a photo of a toy", num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np")
    assert out.images.shape == (1, 64, 64, 3)


def test_sdxl_at_its_real_size_defaults_to_1024(tmp_path: Path) -> None:
    d = _pipeline(tmp_path, SDXL_INDEX, {"addition_embed_type": "text_time", "sample_size": 128}, VAE)
    assert detect_family(d).default_resolution == 1024


def test_the_flow_pipelines_are_told_apart(tiny_flux_model: Path, tiny_sd3_model: Path) -> None:
    flux = detect_family(tiny_flux_model)
    assert (flux.name, flux.is_flow, flux.guidance_embeds) == ("flux", True, True)
    assert flux.spec.denoiser == "transformer" and flux.spec.ov_pipeline_class == "OVFluxPipeline"
    assert [flux.spec.text_encoder_class(i) for i in range(2)] == ["CLIPTextModel", "T5EncoderModel"]
    assert (flux.default_resolution, flux.pixel_multiple) == (64, 16)  # tiny: 8 latents x 8; packed 2x2
    sd3 = detect_family(tiny_sd3_model)
    assert (sd3.name, sd3.is_flow, sd3.guidance_embeds) == ("sd3", True, False)
    assert sd3.text_encoders == ("text_encoder", "text_encoder_2", "text_encoder_3")
    assert sd3.spec.text_encoder_class(2) == "T5EncoderModel"


FLUX_INDEX = {
    "_class_name": "FluxPipeline",
    **{k: C for k in ("vae", "scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")},
    "transformer": ["diffusers", "FluxTransformer2DModel"],
}


def test_flux_schnell_and_the_real_sizes(tmp_path: Path) -> None:
    d = _pipeline(tmp_path, FLUX_INDEX, None, VAE, {"_class_name": "FluxTransformer2DModel", "guidance_embeds": False})
    family = detect_family(d)
    assert (family.name, family.guidance_embeds, family.default_resolution) == ("flux", False, 1024)


@pytest.mark.parametrize(
    ("index", "unet", "expected"),
    [
        (
            {"_class_name": "PixArtSigmaPipeline", "transformer": ["diffusers", "PixArtTransformer2DModel"]},
            None,
            "PixArt",
        ),
        (
            {
                **FLUX_INDEX,
                "_class_name": "Flux2KleinPipeline",
                "transformer": ["diffusers", "Flux2Transformer2DModel"],
            },
            None,
            "FLUX.2",
        ),
        ({**FLUX_INDEX, "text_encoder_2": [None, None]}, None, "a FLUX.1 pipeline without text_encoder_2"),
        (
            {
                "_class_name": "StableDiffusionXLImg2ImgPipeline",
                "requires_aesthetics_score": True,
                **{k: C for k in ("vae", "unet", "scheduler", "text_encoder_2", "tokenizer_2")},
                "text_encoder": [None, None],
                "tokenizer": [None, None],
            },
            {"addition_embed_type": "text_time"},
            "an SDXL refiner",
        ),
        (
            {"_class_name": "StableDiffusionInpaintPipeline", **{k: C for k in ("vae", "unet", "scheduler")}},
            {"in_channels": 9},
            "9 input channels",
        ),
        ({**SDXL_INDEX, "tokenizer_2": [None, None]}, {"addition_embed_type": "text_time"}, "without tokenizer_2"),
    ],
)
def test_other_families_are_refused_naming_what_was_found(
    tmp_path: Path, index: dict, unet: dict | None, expected: str
) -> None:
    transformer = {"_class_name": index["transformer"][1]} if "transformer" in index else None
    d = _pipeline(tmp_path, index, unet, VAE, transformer)
    with pytest.raises(FamilyError) as err:
        detect_family(d)
    msg = str(err.value)
    assert expected in msg and index["_class_name"] in msg and "supported: SD 1.x/2.x" in msg
    assert "\n" not in msg


def test_a_pipeline_without_readable_configs_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "broken"
    d.mkdir()
    (d / "model_index.json").write_text("{not json")
    with pytest.raises(FamilyError, match="cannot read model_index.json"):
        detect_family(d)


def test_the_prompt_length_is_diffusers_default_capped_by_the_tokenizer(tmp_path) -> None:
    """One rule for T5's prompt length (trainer tables, memory estimate, export, engines): the family pipeline's
    own ``max_sequence_length`` default, at most the T5 tokenizer's limit read from the directory."""
    import inspect
    import json

    import diffusers

    from xeonsd.families import SPECS

    # QwenImageEditPlusPipeline truncates nothing (its default of 512 is only checked against 1024): the
    # instruction and up to 3 references' vision tokens (~200 each at its 384x384 condition area) take up to 1024
    widest = {"qwenimage_edit": 1024}
    for found in SPECS.values():
        call = inspect.signature(getattr(diffusers, found.pipeline_class).__call__).parameters
        default = call["max_sequence_length"].default if "max_sequence_length" in call else None
        default = widest.get(found.name, default)
        assert found.max_sequence_length == default, found.name
        assert found.prompt_length_of(tmp_path / "no-such-dir") == default
    flux = SPECS["flux"]
    assert flux.prompt_length(32) == 32 and flux.prompt_length(1e30) == 512 and flux.prompt_length(None) == 512
    (tmp_path / "tokenizer_2").mkdir()
    (tmp_path / "tokenizer_2" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 77}))
    assert flux.prompt_length_of(tmp_path) == 77


def _transformer_pipelines(found) -> list[str]:
    """The diffusers pipeline classes whose ``transformer`` is ``found``'s denoiser class (from their signatures)."""
    import inspect

    import diffusers

    out = []
    for name in dir(diffusers):
        if not name.endswith("Pipeline"):
            continue
        try:
            params = inspect.signature(getattr(diffusers, name).__init__).parameters
        except (TypeError, ValueError, ImportError, AttributeError):
            continue
        hint = params.get("transformer")
        if hint is not None and found.denoiser_class in str(getattr(hint.annotation, "__name__", hint.annotation)):
            out.append(name)
    return sorted(out)


def _index_of(found, cls: str) -> tuple[dict, dict]:
    """model_index.json of a ``cls`` pipeline with ``found``'s components, and its transformer config."""
    index = {"_class_name": cls, "vae": C, "scheduler": C, "transformer": ["diffusers", found.denoiser_class]}
    for i, (encoder, tokenizer) in enumerate(found.text_side):
        index[encoder] = ["transformers", found.text_encoder_class(i)]
        index[tokenizer] = C
    if found.processor:  # the pipeline's processor component (Qwen-Image-Edit's)
        index[found.processor] = ["transformers", "Qwen2VLProcessor"]
    return index, {"_class_name": found.denoiser_class}


@pytest.mark.parametrize("name", ["flux", "sd3", "flux2", "zimage", "qwenimage", "krea2"])
def test_every_pipeline_on_a_known_transformer_trains_or_is_refused_by_name(tmp_path: Path, name: str) -> None:
    """Each diffusers pipeline class built on the family's transformer is either one the family trains as (detected
    as it) or a variant that trains otherwise (an edit model, a ControlNet), refused before any weight loads,
    naming the pipeline and what it is; a pipeline class diffusers adds later fails here until it is classified."""
    from xeonsd.families import REGISTRY, by_name

    found = by_name(name)
    classes = _transformer_pipelines(found)
    assert found.pipeline_class in classes
    # the families on this transformer class (FLUX.1 and FLUX.1 Kontext; FLUX.2 [klein] and [dev]) share its
    # pipelines out between them
    sharing = [f for f in REGISTRY if f.denoiser_class == found.denoiser_class]
    trained = {cls: f for f in sharing for cls in f.pipelines}
    refused = {cls: what for f in sharing for cls, what in f.variants}
    unclassified = set(classes) - set(trained) - set(refused)
    assert not unclassified, f"classify in xeonsd/families/{name}/__init__.py (pipeline_aliases or variants)"
    for i, cls in enumerate(classes):
        index, transformer = _index_of(trained.get(cls, found), cls)  # with the text encoders of its family
        (tmp_path / str(i)).mkdir()
        d = _pipeline(tmp_path / str(i), index, None, VAE, transformer)
        if cls in trained:
            assert detect_family(d).spec is trained[cls], cls
            continue
        with pytest.raises(FamilyError) as err:
            detect_family(d)
        msg = str(err.value)
        assert cls in msg and refused[cls] in msg and "not trained here" in msg, msg


def test_the_edit_models_users_bring_are_refused_before_loading(tmp_path: Path) -> None:
    """Qwen-Image-Edit (the first release) and FLUX.1 Fill sit on the text-to-image families' transformers: without
    the pipeline's class they would train as text-to-image models, silently without their reference images or masks.
    (FLUX.1 Kontext, Qwen-Image-Edit-2511 and FLUX.2 [dev], on the same transformers, are families of their own:
    test_flux_kontext_train.py, test_qwenimage_edit_train.py, test_flux2_dev_train.py.)"""
    from xeonsd.families import by_name

    for i, (name, cls, what) in enumerate(
        (
            ("qwenimage", "QwenImageEditPipeline", "Qwen-Image-Edit"),
            ("flux", "FluxFillPipeline", "FLUX.1 Fill"),
        )
    ):
        index, transformer = _index_of(by_name(name), cls)
        (tmp_path / str(i)).mkdir()
        d = _pipeline(tmp_path / str(i), index, None, VAE, transformer)
        with pytest.raises(FamilyError, match=f"{what}, an (edit|inpainting) model"):
            detect_family(d)
    # a pipeline class no family knows, on a known transformer, is refused too, naming what the family trains as
    index, transformer = _index_of(by_name("zimage"), "ZImageSomethingNewPipeline")
    (tmp_path / "new").mkdir()
    with pytest.raises(FamilyError, match="a ZImageSomethingNewPipeline on Z-Image's transformer: Z-Image trains as"):
        detect_family(_pipeline(tmp_path / "new", index, None, VAE, transformer))


def test_the_readme_family_table_is_the_registry() -> None:
    """The README's family table is the registry: each family in its order, its pipeline class and its methods
    (textual inversion where it has a concept layout)."""
    from repo_code import REPO

    from xeonsd.families import REGISTRY

    lines = (REPO / "README.md").read_text().splitlines()
    start = lines.index("<!-- families: xeonsd.families.REGISTRY, held equal by tests/xeonsd/test_families.py -->")
    table = []
    for line in lines[start + 1 :]:
        if not line.startswith("|"):
            if table:
                break
            continue
        table.append([c.strip() for c in line.strip().strip("|").split("|")])
    want = [
        [f.label, f"`{f.pipeline_class}`", ("textual inversion, " if f.concept_layout else "") + "LoRA, full"]
        for f in REGISTRY
    ]
    assert table[2:] == want

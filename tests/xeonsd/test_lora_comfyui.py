"""``--save_format comfyui`` (:mod:`xeonsd.modelfiles.lora_comfyui`): every family's and every adapter type's file is
what ComfyUI's loader reads, checked against ComfyUI's own source (Comfy-Org/ComfyUI):

* names: each module under a name ComfyUI maps onto its model (:data:`COMFYUI_NAMES`, transcribed from
  ``comfy/lora.py`` at 17358c8f: ``model_lora_keys_unet`` and ``model_lora_keys_clip``, and the diffusers-name maps
  in ``comfy/utils.py`` at 09708eae: ``unet_to_diffusers``, ``mmdit_to_diffusers``, ``flux_to_diffusers`` (FLUX.1,
  Kontext, FLUX.2), ``krea2_to_diffusers``, ``z_image_to_diffusers``, and Qwen-Image's own module names), with the
  parts its adapter classes read (``comfy/weight_adapter/`` at a125cd84);
* values: ComfyUI's patch rules (:func:`comfy_weight`, re-stated from ``comfy/weight_adapter/``) give the weight
  peft merges, for LoRA with alpha != rank (ComfyUI takes a missing alpha as scale 1), DoRA (ComfyUI divides by the
  base weight's norm, peft by the adapted one's), LoKr (factored, and whole where ComfyUI reads no rank) and LoHa.

The trainer's runs with ``--save_format comfyui`` are in tests/xeonsd/trainer/test_adapters.py.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

from xeonsd.assets import make_tiny_model
from xeonsd.families import SPECS, detect_family
from xeonsd.modelfiles.lora_comfyui import ComfyUIError, comfyui_tensors, write_comfyui
from xeonsd.trainer.methods.adapters import adapter_config
from xeonsd.trainer.methods.lora import TEXT_ENCODER_TARGETS

# A joint block's attention in diffusers' names (SD3, FLUX.1/.2, Qwen-Image): image and text stream.
_JOINT = r"attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)"
_UNET = (  # unet_to_diffusers: the transformer blocks' and resnets' layers, kohya's lora_unet_ with dots as _
    r"lora_unet_(down_blocks_\d+_attentions_\d+|up_blocks_\d+_attentions_\d+|mid_block_attentions_0)_"
    r"(transformer_blocks_\d+_(attn[12]_(to_q|to_k|to_v|to_out_0)|ff_net_0_proj|ff_net_2)|proj_in|proj_out)"
    r"|lora_unet_(down_blocks_\d+|up_blocks_\d+|mid_block)_resnets_\d+_(conv1|conv2|time_emb_proj|conv_shortcut)"
)
_FLUX = (  # flux_to_diffusers (FLUX.1, Kontext and FLUX.2: Flux2 is a Flux in comfy/model_base.py)
    rf"transformer\.(transformer_blocks\.\d+\.({_JOINT}|ff(_context)?\.(net\.0\.proj|net\.2|linear_in|linear_out)"
    r"|norm1(_context)?\.linear)|single_transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_qkv_mlp_proj|to_out)"
    r"|proj_mlp|proj_out|norm\.linear)|x_embedder|context_embedder|proj_out)"
)
_QWEN = (  # QwenImage: its own module names, which are diffusers'
    rf"transformer\.(transformer_blocks\.\d+\.({_JOINT}|(img|txt)_mlp\.net\.(0\.proj|2)|(img|txt)_mod\.1)"
    r"|img_in|txt_in|proj_out)"
)
COMFYUI_NAMES = {
    "sd": _UNET,
    "sdxl": _UNET,
    "sd3": rf"transformer\.transformer_blocks\.\d+\.({_JOINT}|attn2\.(to_q|to_k|to_v|to_out\.0)"
    r"|ff(_context)?\.net\.(0\.proj|2)|norm1(_context)?\.linear)",
    "flux": _FLUX,
    "flux_kontext": _FLUX,
    "flux2": _FLUX,
    "flux2_dev": _FLUX,
    "krea2": r"transformer\.((transformer_blocks|text_fusion\.(layerwise|refiner)_blocks)\.\d+\."
    r"(attn\.(to_q|to_k|to_v|to_gate|to_out\.0|to_out)|ff\.(gate|up|down))|img_in|time_embed\.linear_[12]"
    r"|time_mod_proj|txt_in\.linear_[12]|text_fusion\.projector|final_layer\.linear)",
    "zimage": r"transformer\.((layers|noise_refiner|context_refiner)\.\d+\.(attention\.(to_q|to_k|to_v|to_out\.0)"
    r"|feed_forward\.w[123]|adaLN_modulation\.0)|all_final_layer\.2-1\.(linear|adaLN_modulation\.1)"
    r"|all_x_embedder\.2-1|cap_embedder\.1|t_embedder\.mlp\.[02])",
    "qwenimage": _QWEN,
    "qwenimage_edit": _QWEN,
}
# model_lora_keys_clip: CLIP-L/H as text_encoder, CLIP-G as text_encoder_2 beside CLIP-L; layers 0-31
CLIP_NAMES = (
    r"text_encoder(_2)?\.text_model\.encoder\.layers\.([0-9]|[12][0-9]|3[01])\."
    r"(self_attn\.(q_proj|k_proj|v_proj|out_proj)|mlp\.fc[12])"
)
# The parts each of ComfyUI's adapter classes reads (load_lora: alpha and dora_scale for all).
_PART = re.compile(
    r"^(?P<module>.+)\.(?P<part>lora_down\.weight|lora_up\.weight|alpha|dora_scale"
    r"|lokr_w1|lokr_w1_a|lokr_w1_b|lokr_w2|lokr_w2_a|lokr_w2_b|lokr_t2|hada_w[12]_[ab]|hada_t[12])$"
)
TINY_ARCHS = (
    "tiny",
    "tiny-xl",
    "tiny-sd3",
    "tiny-flux",
    "tiny-flux-kontext",
    "tiny-flux2",
    "tiny-flux2-dev",
    "tiny-krea2",
    "tiny-zimage",
    "tiny-qwenimage",
    "tiny-qwenimage-edit",
)


def test_the_tables_cover_every_registered_family():
    assert set(COMFYUI_NAMES) == set(SPECS)


def random_components(arch: str, root: Path) -> tuple[str, dict[str, torch.nn.Module]]:
    """The tiny pipeline ``arch``'s family name and its denoiser and CLIP text encoders, random weights, built from
    their configs (no weights read)."""
    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModel

    model = make_tiny_model(root / arch, arch=arch)
    family = detect_family(model).spec
    cls = getattr(diffusers, family.denoiser_class)
    components = {family.denoiser: cls.from_config(cls.load_config(model, subfolder=family.denoiser))}
    for name in family.clip_encoders:
        components[name] = CLIPTextModel(CLIPTextConfig.from_pretrained(model / name))
    return family.name, components


def add_adapters(components: dict[str, torch.nn.Module], adapter: str, rank: int, alpha: float, targets) -> None:
    """The trainer's adapters (its peft configs) on the denoiser, plain LoRA on the text encoders, then every adapter
    weight drawn at random (LoRA's B and LoKr's w1 start at zero; DoRA's magnitude kept near the weight's norm)."""
    torch.manual_seed(0)
    for name, module in components.items():
        clip = name.startswith("text_encoder")
        config = adapter_config(
            "lora" if clip else adapter, rank, alpha, list(TEXT_ENCODER_TARGETS if clip else targets)
        )
        module.add_adapter(config)
        for pname, p in module.named_parameters():
            if "lora_magnitude_vector" in pname:
                p.data *= 1 + 0.2 * torch.rand_like(p)
            elif any(part in pname for part in ("lora_", "lokr_", "hada_")):
                p.data = 0.1 * torch.randn_like(p)


def split(tensors: dict[str, torch.Tensor]) -> dict[str, set[str]]:
    """{module: its parts} of a ComfyUI file's keys; a key of no part ComfyUI reads fails the test."""
    modules: dict[str, set[str]] = {}
    for key in tensors:
        m = _PART.match(key)
        assert m, f"{key}: no part ComfyUI's adapter classes read"
        modules.setdefault(m["module"], set()).add(m["part"])
    return modules


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_each_familys_lora_is_named_as_comfyui_maps_its_model(arch, tmp_path):
    """The family's default LoRA layers (and LoRA on its CLIP encoders): every module under a name ComfyUI maps for
    that family, each with down, up and alpha, none lost."""
    family, components = random_components(arch, tmp_path)
    targets = SPECS[family].training.lora_targets
    add_adapters(components, "lora", 4, 2.0, targets)
    modules = split(comfyui_tensors(components))
    adapted = sum(1 for c in components.values() for n, _ in c.named_modules() if n.endswith((".to_q", ".q_proj")))
    assert adapted and len(modules) >= adapted
    names = re.compile(rf"^({COMFYUI_NAMES[family]}|{CLIP_NAMES})$")
    strangers = sorted(m for m in modules if not names.match(m))
    assert not strangers, f"{family}: ComfyUI maps no module named {strangers[:3]}"
    assert all(parts == {"lora_down.weight", "lora_up.weight", "alpha"} for parts in modules.values())
    if len(components) > 1:  # the CLIP encoders' adapters are there too
        assert any(m.startswith("text_encoder.") for m in modules)


def comfy_weight(tensors: dict[str, torch.Tensor], module: str, weight: torch.Tensor) -> torch.Tensor:
    """The weight ComfyUI makes of ``weight`` with the file's patch for ``module`` at strength 1, as its adapter
    classes do: alpha / the rank it reads (1 where no alpha or no factored matrix), DoRA's scale on the output
    axis divided by the base weight's row norms."""
    t = {k[len(module) + 1 :]: v.float() for k, v in tensors.items() if k.startswith(f"{module}.")}
    alpha = float(t["alpha"]) if "alpha" in t else None
    if "lora_up.weight" in t:
        diff, rank = t["lora_up.weight"] @ t["lora_down.weight"], t["lora_down.weight"].shape[0]
    elif "hada_w1_a" in t:
        diff = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
        rank = t["hada_w1_b"].shape[0]
    else:
        rank = None
        w1 = t.get("lokr_w1")
        if w1 is None:
            w1, rank = t["lokr_w1_a"] @ t["lokr_w1_b"], t["lokr_w1_b"].shape[0]
        w2 = t.get("lokr_w2")
        if w2 is None:
            w2, rank = t["lokr_w2_a"] @ t["lokr_w2_b"], t["lokr_w2_b"].shape[0]
        diff = torch.kron(w1, w2)
    scale = alpha / rank if alpha is not None and rank is not None else 1.0
    patched = weight + scale * diff.reshape(weight.shape)
    if "dora_scale" in t:
        norm = weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True) + torch.finfo(torch.float32).eps
        patched = patched * (t["dora_scale"] / norm)
    return patched


@pytest.mark.parametrize(
    ("arch", "adapter", "rank", "alpha"),
    [
        ("tiny", "lora", 4, 2.0),  # alpha != rank: a file without the alpha would load at twice the strength
        ("tiny-flux", "dora", 4, 8.0),
        ("tiny", "lokr", 2, 3.0),  # w1 whole, w2 factored: ComfyUI's rank is w2_b's
        ("tiny", "lokr", 64, 3.0),  # both whole (rank >= half the layer): ComfyUI scales by 1, the scale is in w1
        ("tiny-flux", "loha", 4, 2.0),
    ],
)
def test_comfyui_makes_the_weight_peft_merges(arch, adapter, rank, alpha, tmp_path):
    family, components = random_components(arch, tmp_path)
    denoiser = components["unet" if family == "sd" else "transformer"]
    add_adapters({"d": denoiser}, adapter, rank, alpha, ["to_q", "to_k", "to_v", "to_out.0"])
    out = write_comfyui({"unet" if family == "sd" else "transformer": denoiser}, tmp_path / "c.safetensors", {})
    from safetensors.torch import load_file

    tensors = load_file(str(out))
    if (adapter, rank) == ("lokr", 64):
        assert not any(k.endswith((".alpha", "_b")) for k in tensors)
    layers = [(n, m) for n, m in denoiser.named_modules() if hasattr(m, "merge") and hasattr(m, "get_base_layer")]
    assert layers
    for name, layer in layers:
        base = layer.get_base_layer().weight.detach().float().clone()
        merged = copy.deepcopy(layer)
        merged.merge(adapter_names=["default"])
        prefix = ("lora_unet_" + name.replace(".", "_")) if family == "sd" else f"transformer.{name}"
        expected = merged.get_base_layer().weight.detach().float()
        got = comfy_weight(tensors, prefix, base)
        assert (expected - base).abs().max() > 1e-3, name  # the adapter changes the weight
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=name)


def test_a_model_without_adapters_is_refused():
    with pytest.raises(ComfyUIError, match="no adapter 'default' on transformer"):
        comfyui_tensors({"transformer": torch.nn.Linear(2, 2)})

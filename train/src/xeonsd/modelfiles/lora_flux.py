"""FLUX.1 LoRA in the kohya layout (BFL module names), the one ComfyUI and Forge load, to and from diffusers' modules.

diffusers names FLUX.1's transformer modules its own way (``transformer_blocks.N.attn.to_q``); kohya's sd-scripts,
ComfyUI and Forge use Black Forest Labs' original names, where the attention's query, key and value are one fused
linear layer: ``lora_unet_double_blocks_N_img_attn_qkv`` (``to_q``/``to_k``/``to_v``),
``..._txt_attn_qkv`` (``add_q_proj``/``add_k_proj``/``add_v_proj``) and ``lora_unet_single_blocks_N_linear1``
(``to_q``/``to_k``/``to_v``/``proj_mlp``, output rows 3 x inner + 4 x inner). diffusers' loader
(``_convert_kohya_flux_lora_to_diffusers``) and OpenVINO GenAI's (``flux_kohya_lora_preprocessing``) map these
names back, splitting a fused layer's up matrix by rows.

A fused layer from separate adapters: the down matrices stacked (rank r_q + r_k + r_v) and the up matrices placed
block-diagonally, each scaled by its own alpha/rank (the fused layer's alpha is then its rank): the product is
exactly the separate deltas stacked by rows, and a part without an adapter gets zero rows. Both loaders find such
a block-diagonal up matrix "sparse" and split it back into the original ranks when they are equal.

Pure numpy, no xeonsd import: :mod:`xeonsd.modelfiles.lora_layout` reads and writes the files.
"""

from __future__ import annotations

import re

import numpy as np

# diffusers module (after ``transformer.``), with {i} the block -> kohya/BFL module (after ``lora_unet_``)
_DOUBLE = {
    "attn.to_out.0": "img_attn_proj",
    "attn.to_add_out": "txt_attn_proj",
    "ff.net.0.proj": "img_mlp_0",
    "ff.net.2": "img_mlp_2",
    "ff_context.net.0.proj": "txt_mlp_0",
    "ff_context.net.2": "txt_mlp_2",
    "norm1.linear": "img_mod_lin",
    "norm1_context.linear": "txt_mod_lin",
}
_SINGLE = {"proj_out": "linear2", "norm.linear": "modulation_lin"}
_GLOBAL = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_text_embed.timestep_embedder.linear_1": "time_in_in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in_out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in_in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in_out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in_in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in_out_layer",
}
# fused BFL layers: name -> its diffusers parts, in row order
_FUSED_DOUBLE = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
_FUSED_SINGLE = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
_BLOCK = re.compile(r"^(?P<kind>transformer_blocks|single_transformer_blocks)\.(?P<i>\d+)\.(?P<rest>.+)$")
_BFL_BLOCK = re.compile(r"^(?P<kind>double_blocks|single_blocks)_(?P<i>\d+)_(?P<rest>.+)$")

# (down, up, scale): scale is alpha / rank, what up @ down is multiplied by
Lora = tuple[np.ndarray, np.ndarray, float]


def bfl_name(module: str) -> tuple[str, str | None] | None:
    """The kohya/BFL module (after ``lora_unet_``) of a diffusers transformer module, with the fused part it is (None:
    a layer of its own); None for a module kohya's layout has no name for."""
    if module in _GLOBAL:
        return _GLOBAL[module], None
    m = _BLOCK.match(module)
    if m is None:
        return None
    single = m["kind"] == "single_transformer_blocks"
    prefix = f"{'single_blocks' if single else 'double_blocks'}_{m['i']}_"
    plain, fused = (_SINGLE, _FUSED_SINGLE) if single else (_DOUBLE, _FUSED_DOUBLE)
    if m["rest"] in plain:
        return prefix + plain[m["rest"]], None
    for name, parts in fused.items():
        if m["rest"] in parts:
            return prefix + name, m["rest"]
    return None


def to_kohya(modules: dict[str, Lora]) -> dict[str, Lora]:
    """diffusers transformer modules -> kohya/BFL layers (down, up, scale; 1 for a fused layer). A fused layer's parts
    are the transformer's width wide (``to_q``, ``to_k``, ``to_v``, read from an adapted part) and a single block's
    MLP part 4 x that (FLUX.1's MLP ratio); a part without an adapter gets zero rows. A module without a kohya name
    is a KeyError naming it."""
    out: dict[str, Lora] = {}
    fused: dict[str, dict[str, Lora]] = {}
    for module, lora in modules.items():
        found = bfl_name(module)
        if found is None:
            raise KeyError(module)
        name, part = found
        if part is None:
            out[name] = lora
        else:
            fused.setdefault(name, {})[part] = lora
    for name, parts in fused.items():
        m = _BFL_BLOCK.match(name)
        assert m is not None
        order = (_FUSED_SINGLE if m["kind"] == "single_blocks" else _FUSED_DOUBLE)[m["rest"]]
        inner = next(up.shape[0] // (4 if p == "proj_mlp" else 1) for p, (_, up, _) in parts.items())
        rows = [4 * inner if p == "proj_mlp" else inner for p in order]
        downs = [parts[p][0].astype(np.float32) for p in order if p in parts]
        up = np.zeros((sum(rows), sum(d.shape[0] for d in downs)), dtype=np.float32)
        r0 = c0 = 0
        for p, n in zip(order, rows, strict=True):
            if p in parts:
                down, part_up, scale = parts[p]
                up[r0 : r0 + n, c0 : c0 + down.shape[0]] = part_up.astype(np.float32) * scale
                c0 += down.shape[0]
            r0 += n
        out[name] = (np.concatenate(downs, axis=0), up, 1.0)
    return out


def from_kohya(name: str, lora: Lora) -> dict[str, Lora]:
    """One kohya/BFL layer (after ``lora_unet_``) -> its diffusers transformer module(s); a fused layer's up matrix is
    split by rows (query, key and value a third each; a single block's ``linear1``: 1/7 each and its MLP 4/7, FLUX.1's
    MLP ratio). Every part keeps the whole down matrix (exact: the zero columns of a block-diagonal up contribute
    nothing). {} for a name FLUX.1's layout does not have."""
    for module, bfl in _GLOBAL.items():
        if bfl == name:
            return {module: lora}
    m = _BFL_BLOCK.match(name)
    if m is None:
        return {}
    single = m["kind"] == "single_blocks"
    block = f"{'single_transformer_blocks' if single else 'transformer_blocks'}.{m['i']}."
    plain, fused = (_SINGLE, _FUSED_SINGLE) if single else (_DOUBLE, _FUSED_DOUBLE)
    for module, bfl in plain.items():
        if bfl == m["rest"]:
            return {block + module: lora}
    parts = fused.get(m["rest"])
    if parts is None:
        return {}
    down, up, scale = lora
    inner = up.shape[0] // (7 if single else 3)
    sizes = [4 * inner if p == "proj_mlp" else inner for p in parts]
    if sum(sizes) != up.shape[0]:
        return {}
    out, r0 = {}, 0
    for part, n in zip(parts, sizes, strict=True):
        out[block + part] = (down, up[r0 : r0 + n], scale)
        r0 += n
    return out


def is_kohya_flux(names: list[str]) -> bool:
    """Kohya names (``lora_unet_...``) in FLUX.1's BFL layout."""
    return any(_BFL_BLOCK.match(n[len("lora_unet_") :]) for n in names if n.startswith("lora_unet_"))

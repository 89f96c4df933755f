"""A learned concept (``learned_embeds.safetensors``) added to a pipeline's tokenizer and text encoder.

One loader for both places a concept goes in after training: the PyTorch text encoder before an OpenVINO export
(``xeonsd export --embeds``), and the text encoder of an already exported OpenVINO pipeline
(``xeonsd generate --embeds``), where the vectors are appended to the embedding table of the OpenVINO graph.

The file format is the one diffusers' ``load_textual_inversion`` reads: ``{token: tensor[num_vectors, hidden]}``
(or ``[hidden]``); a concept with ``num_vectors > 1`` becomes the tokens ``<tok>``, ``<tok>_1``, … in that order.
The A1111 formats (``string_to_param`` / ``emb_params``) are read too when ``token`` names the concept.

SDXL has two text encoders, so an SDXL concept is two vector sets in one safetensors file, the layout the
community's SDXL embeddings use: ``clip_l`` ``[num_vectors, 768]`` for ``text_encoder`` (CLIP ViT-L) and ``clip_g``
``[num_vectors, 1280]`` for ``text_encoder_2`` (OpenCLIP bigG), the same number of vectors in both. The file's
metadata ``token`` names the concept (our writer, :func:`save_xl_concept`, stores it; community files have none,
so ``--token`` names it). :func:`load_concepts` reads the layout of the model's family and refuses the other one.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from xeonsd.modelfiles.lora_layout import save_tensors

if TYPE_CHECKING:
    from xeonsd.families import FamilySpec

log = logging.getLogger(__name__)

# Friendly names the optimum-intel exporter gives the CLIP token-embedding table in the OpenVINO graph.
OV_EMBEDDING_TABLE_NAMES = (
    "self.text_model.embeddings.token_embedding.weight",
    "self.model.text_model.embeddings.token_embedding.weight",
)


class ConceptError(ValueError):
    """The embeddings file cannot be added to this tokenizer / text encoder."""


@dataclass(frozen=True)
class Concept:
    """The token(s) of a learned concept and their vectors (float32, one row per token)."""

    tokens: list[str]
    vectors: np.ndarray
    source: str
    sha256: str

    @property
    def hidden_size(self) -> int:
        return int(self.vectors.shape[1])


def expand_tokens(token: str, num_vectors: int) -> list[str]:
    """``<tok>``, ``<tok>_1``, … : the names diffusers gives the vectors of a multi-vector concept."""
    return [token] + [f"{token}_{i}" for i in range(1, num_vectors)]


def _read_state_dict(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConceptError(f"embeddings file {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.numpy import load_file

        try:
            return dict(load_file(str(path)))
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise ConceptError(f"{path} is not a readable safetensors file: {exc}") from exc
    import torch

    try:
        raw = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConceptError(f"{path} is not a readable PyTorch embeddings file: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConceptError(f"{path} holds a {type(raw).__name__}, not a dict of embeddings")
    return raw


def _as_array(value: Any, path: Path) -> np.ndarray:
    if hasattr(value, "detach"):
        value = value.detach().to("cpu").float().numpy()
    arr = np.asarray(value, dtype=np.float32)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ConceptError(f"{path}: expected embeddings of shape [num_vectors, hidden], got {list(arr.shape)}")
    if not np.isfinite(arr).all():
        raise ConceptError(f"{path}: the embeddings contain NaN or infinite values")
    return np.ascontiguousarray(arr)  # what safetensors writes


def load_concept(path: Path, token: str | None = None) -> Concept:
    """Read a learned-embeddings file; ``token`` renames the concept (required for the A1111 formats)."""
    path = Path(path)
    state = _read_state_dict(path)
    if "string_to_param" in state:  # A1111 .pt
        name, vectors = token, next(iter(state["string_to_param"].values()))
    elif "emb_params" in state:  # A1111 .safetensors
        name, vectors = token, state["emb_params"]
    elif is_xl_layout(state):
        raise ConceptError(
            f"{path} is an SDXL concept (one vector set per text encoder: {', '.join(XL_KEYS)}); it goes into an "
            "SDXL pipeline's two text encoders, not into one"
        )
    elif len(state) == 1:
        (key, vectors), name = next(iter(state.items())), None
        name = token or key
    else:
        raise ConceptError(
            f"{path} holds {len(state)} tensors ({sorted(state)[:5]}); expected one {{token: [num_vectors, hidden]}}"
        )
    if not name:
        raise ConceptError(f"{path} does not name its token; pass --token '<my-concept>'")
    arr = _as_array(vectors, path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return Concept(tokens=expand_tokens(name, arr.shape[0]), vectors=arr, source=str(path), sha256=digest)


def token_taken(tokenizer: Any, token: str, vocab: dict[str, int] | None = None) -> bool:
    """An exact vocabulary entry (incl. an added token), or a word the tokenizer already reads as one existing
    token (CLIP stores "photo" as "photo</w>"): adding it would hijack that word in every prompt."""
    vocab = tokenizer.get_vocab() if vocab is None else vocab
    return token in vocab or len(tokenizer.encode(token, add_special_tokens=False)) == 1


def check_concept(concept: Concept, tokenizer: Any, hidden_size: int) -> None:
    """Refuse a concept whose vector size does not fit the text encoder or whose tokens are already taken."""
    if concept.hidden_size != hidden_size:
        raise ConceptError(
            f"{concept.source}: vectors have {concept.hidden_size} values but this text encoder's hidden size is "
            f"{hidden_size}; the embeddings were trained for a different model"
        )
    vocab = tokenizer.get_vocab()
    for tok in concept.tokens:
        if token_taken(tokenizer, tok, vocab):
            ids = tokenizer.encode(tok, add_special_tokens=False)
            existing = vocab.get(tok, ids[0] if ids else None)
            raise ConceptError(
                f"token {tok!r} collides with an existing token of the tokenizer (id {existing}); the model already "
                "knows this word (or the concept is already in it). Load it under another name with --token"
            )


def _add_tokens(tokenizer: Any, concept: Concept) -> list[int]:
    first = len(tokenizer)
    added = tokenizer.add_tokens(concept.tokens)
    ids = tokenizer.convert_tokens_to_ids(concept.tokens)
    if added != len(concept.tokens) or ids != list(range(first, first + len(ids))):
        raise ConceptError(f"tokenizer gave the concept tokens {concept.tokens} the ids {ids}, expected {first}…")
    return ids


def add_to_torch(tokenizer: Any, text_encoder: Any, concept: Concept) -> list[int]:
    """Add the concept to a transformers tokenizer and a PyTorch CLIP text encoder; returns the new ids."""
    import torch

    check_concept(concept, tokenizer, text_encoder.get_input_embeddings().weight.shape[1])
    rows = text_encoder.get_input_embeddings().weight.shape[0]
    if rows != len(tokenizer):
        raise ConceptError(f"text encoder has {rows} embedding rows but the tokenizer {len(tokenizer)} tokens")
    ids = _add_tokens(tokenizer, concept)
    text_encoder.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        weight = text_encoder.get_input_embeddings().weight
        weight[ids] = torch.from_numpy(concept.vectors).to(weight.dtype)
    log.info("added concept %s (%d vector(s)) as ids %s", concept.tokens, len(ids), ids)
    return ids


def ov_embedding_table(model: Any) -> Any:
    """The token-embedding Constant of an exported CLIP text encoder (an ``openvino.Model``)."""
    for op in model.get_ops():
        if op.get_type_name() == "Constant" and op.get_friendly_name() in OV_EMBEDDING_TABLE_NAMES:
            return op
    raise ConceptError("the OpenVINO text encoder has no token-embedding table the concept could be added to")


def ov_vocab_rows(model: Any) -> int:
    """Rows of the token-embedding table of an OpenVINO text encoder (the vocabulary it was exported with)."""
    return int(ov_embedding_table(model).get_output_partial_shape(0)[0].get_length())


def add_to_openvino(tokenizer: Any, text_encoder_model: Any, concept: Concept) -> list[int]:
    """Add the concept to a tokenizer and an (uncompiled) OpenVINO CLIP text encoder graph, in place.

    The vectors are appended to the embedding table with optimum-intel's ``InsertTextEmbedding`` pass (the
    same graph edit as ``OVStableDiffusionPipeline.load_textual_inversion``), so the result equals an export
    with the concept baked in.
    """
    from openvino.passes import Manager
    from optimum.intel.openvino.loaders import InsertTextEmbedding

    table = ov_embedding_table(text_encoder_model)
    shape = table.get_output_partial_shape(0)
    rows, hidden = shape[0].get_length(), shape[1].get_length()
    check_concept(concept, tokenizer, hidden)
    if rows != len(tokenizer):
        raise ConceptError(
            f"the OpenVINO text encoder has {rows} embedding rows but the tokenizer beside it has {len(tokenizer)} "
            "tokens: tokenizer and text encoder come from different exports"
        )
    ids = _add_tokens(tokenizer, concept)
    manager = Manager()
    manager.register_pass(InsertTextEmbedding(ids, list(concept.vectors)))
    manager.run_passes(text_encoder_model)
    names = {op.get_friendly_name() for op in text_encoder_model.get_ops()}
    missing = [i for i in ids if f"{table.get_friendly_name()}.textual_inversion_{i}" not in names]
    if missing:
        raise ConceptError(f"could not insert the vectors for ids {missing} into the OpenVINO text encoder")
    log.info("added concept %s to the OpenVINO text encoder as ids %s", concept.tokens, ids)
    return ids


def expand_prompt(prompt: str, tokens: list[str]) -> str:
    """``<tok>`` -> ``<tok> <tok>_1 …`` for multi-vector concepts, as diffusers' ``maybe_convert_prompt`` does.

    The diffusers pipelines (PyTorch and optimum-intel) do this themselves; ``openvino_genai`` does not. ``tokens``
    are the concept tokens of the model (an added token matches anywhere in a prompt, so a substring test finds
    what the tokenizer finds).
    """
    known = set(tokens)
    for token in tokens:
        if f"{token}_1" in known and token in prompt:
            replacement, i = token, 1
            while f"{token}_{i}" in known:
                replacement += f" {token}_{i}"
                i += 1
            prompt = prompt.replace(token, replacement)
    return prompt


def prompt_tokens(tokens: list[str]) -> list[str]:
    """The tokens a prompt names, of a model's concept ``tokens``: each concept's own (``<tok>``), not the
    ``<tok>_1`` … that :func:`expand_prompt` adds after it."""
    known = set(tokens)
    return [t for t in tokens if not (t.rpartition("_")[0] in known and t.rpartition("_")[2].isdigit())]


# --- SDXL: one vector set per text encoder ----------------------------------------------------------------------

XL_KEYS = {"clip_l": "text_encoder", "clip_g": "text_encoder_2"}  # file key -> the SDXL pipeline component
XL_TOKEN_METADATA = "token"


def is_xl_layout(keys: Any) -> bool:
    """The file holds the SDXL layout (``clip_l`` and ``clip_g``)."""
    return set(XL_KEYS) <= set(keys)


def save_xl_concept(path: Path, token: str, clip_l: Any, clip_g: Any) -> Path:
    """Write an SDXL concept (``clip_l`` [n, 768], ``clip_g`` [n, 1280], the token in the metadata) atomically."""
    path = Path(path)
    arrays = _xl_arrays(path, clip_l, clip_g)
    if not token:
        raise ConceptError(f"{path}: an SDXL concept needs a token to be saved under")
    return save_tensors(arrays, path, {"format": "pt", XL_TOKEN_METADATA: token})


def _xl_arrays(path: Path, clip_l: Any, clip_g: Any) -> dict[str, np.ndarray]:
    """An SDXL concept's two vector sets as float32 arrays; ConceptError unless they hold as many vectors."""
    arrays = {"clip_l": _as_array(clip_l, path), "clip_g": _as_array(clip_g, path)}
    if arrays["clip_l"].shape[0] != arrays["clip_g"].shape[0]:
        raise ConceptError(
            f"{path}: clip_l has {arrays['clip_l'].shape[0]} vectors and clip_g {arrays['clip_g'].shape[0]}; "
            "an SDXL concept has the same number in both"
        )
    return arrays


def write_concept_file(path: Path, token: str, vectors: list[Any]) -> Path:
    """Write a concept atomically: one ``[num_vectors, hidden]`` array as ``{token: …}`` (SD 1.x/2.x), or the two
    text encoders' (SDXL) through :func:`save_xl_concept`. float32, ``format: pt`` (what diffusers'
    ``load_textual_inversion`` reads)."""
    if len(vectors) == len(XL_KEYS):
        return save_xl_concept(path, token, *vectors)
    if len(vectors) != 1:
        raise ConceptError(f"a concept has one vector set per text encoder (1 or 2), got {len(vectors)}")
    path = Path(path)
    return save_tensors({token: _as_array(vectors[0], path)}, path, {"format": "pt"})


def load_xl_concept(path: Path, token: str | None = None) -> dict[str, Concept]:
    """Read an SDXL concept file: ``{"text_encoder": Concept(clip_l), "text_encoder_2": Concept(clip_g)}``."""
    path = Path(path)
    state = _read_state_dict(path)
    if not is_xl_layout(state):
        raise ConceptError(
            f"{path} holds {sorted(state)[:5]}, not an SDXL concept (clip_l [n, 768] and clip_g [n, 1280])"
        )
    extra = sorted(set(state) - set(XL_KEYS))
    if extra:
        raise ConceptError(f"{path}: an SDXL concept holds clip_l and clip_g only, this file also {extra[:5]}")
    name = token or _xl_token(path)
    if not name:
        raise ConceptError(f"{path} does not name its token (no {XL_TOKEN_METADATA!r} metadata); pass --token '<tok>'")
    arrays = _xl_arrays(path, state["clip_l"], state["clip_g"])
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    tokens = expand_tokens(name, arrays["clip_l"].shape[0])
    return {
        component: Concept(tokens=tokens, vectors=arrays[key], source=f"{path} ({key})", sha256=digest)
        for key, component in XL_KEYS.items()
    }


def _xl_token(path: Path) -> str | None:
    if path.suffix != ".safetensors":
        return None
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as fh:
        return (fh.metadata() or {}).get(XL_TOKEN_METADATA)


def load_concepts(path: Path, token: str | None, family: FamilySpec) -> dict[str, Concept]:
    """The concept for each text encoder of ``family`` (whose spec's ``concept_layout`` is ``sd``: one vector set,
    or ``xl``: clip_l and clip_g), by component name; a file of the other layout is refused naming both, and a
    family without a concept layout by its name."""
    layout = family.concept_layout
    if layout is None:
        raise ConceptError(f"{family.label} has no textual-inversion concepts here; use a LoRA")
    path = Path(path)
    if not path.is_file():
        raise ConceptError(f"embeddings file {path} does not exist")
    xl_file = path.suffix == ".safetensors" and is_xl_layout(_safetensors_keys(path))
    if layout == "xl":
        if not xl_file:
            raise ConceptError(
                f"{path} is an embedding for SD 1.x/2.x (one text encoder), and this model is SDXL, which needs "
                "one vector set per text encoder: a safetensors file with clip_l and clip_g"
            )
        return load_xl_concept(path, token)
    if xl_file:
        raise ConceptError(
            f"{path} is an SDXL embedding (clip_l and clip_g), and this model is SD 1.x/2.x, which has one "
            "text encoder; use an embedding trained for it"
        )
    return {"text_encoder": load_concept(path, token)}


def _safetensors_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as fh:
            return list(fh.keys())  # noqa: SIM118 - safe_open is not a dict
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ConceptError(f"{path} is not a readable safetensors file: {exc}") from exc

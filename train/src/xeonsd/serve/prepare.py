"""What ``xeonsd serve`` and ``--write-ovms-config`` serve, put together before anything compiles: the options and
the export (:mod:`.options`), the concept of ``--embeds`` (:mod:`.concept`) and the adapters (:mod:`.adapters`)."""

from __future__ import annotations

from pathlib import Path

from xeonsd.serve.adapters import add_adapters
from xeonsd.serve.concept import add_concepts, read_concepts
from xeonsd.serve.options import NAME, ServedModel, ServeError, ServeOptions, blend_keys, check_options, read_export


def prepare(opts: ServeOptions, workdir: Path) -> ServedModel:
    """Check the export, ``--embeds`` and every adapter against it; write each adapter in GenAI's layout, and the
    overlay holding the concept, into ``workdir``."""
    check_options(opts)
    manifest, shape, family = read_export(opts)
    concepts = read_concepts(opts, family)
    export_dir = Path(opts.export_dir)
    name = opts.name or export_dir.resolve().name
    if not NAME.match(name):
        raise ServeError(f"the export's name {name!r} is not a model name; give one with --name")
    served = ServedModel(
        export_dir=export_dir,
        name=name,
        family=family,
        shape=shape,
        concept_tokens=list(manifest.get("concept_tokens", [])),
        max_sequence_length=manifest.get("max_sequence_length"),
        blends=blend_keys(opts),
    )
    if opts.adapters:
        add_adapters(served, opts, manifest, workdir)
    if concepts is not None:
        add_concepts(served, concepts, workdir / "models")
    return served

"""The trainer (``xeonsd train``): one data-parallel loop for every method.

It owns the typed configuration (:mod:`.config`), the images and the rank-independent sampling plan
(:mod:`.data`), captions and prompt tables (:mod:`.captions`, :mod:`.prompts`), their text-encoder conditioning
(:mod:`.conditioning`), VAE latents (:mod:`.latents`), the models (:mod:`.models`), the concept's embedding
(:mod:`.embeddings`), checkpoints, metrics and the memory estimate, the methods (:mod:`.methods`) and the run
itself: the checks before a model loads (:mod:`.inputs`), the job and its set-up (:mod:`.job`), the loop with the
training step, ``fit`` and ``save`` (:mod:`.loop`, also the CLI's ``main``), and what the loop does after each step
besides training (:mod:`.hooks`: status, rank statistics, progress, metrics rows, checkpoints, validation images),
and a clean stop when the job is told to (:mod:`.stopping`: SIGTERM, SIGINT, SIGUSR1).
It may import the top-level modules and :mod:`xeonsd.cluster` (process group, rank statistics, status files);
never :mod:`xeonsd.openvino`, :mod:`xeonsd.ops` or :mod:`xeonsd.bench`.
"""

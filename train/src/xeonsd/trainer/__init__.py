"""The trainer (``xeonsd train``): one data-parallel loop for every method, in six layers. A module imports only
from its own layer and those below (``tests/xeonsd/test_imports.py`` holds the list and fails on an upward import
or any cycle, lazy imports included):

1. what everything else stands on: the typed configuration (:mod:`.config`) and the resolution a family trains at
   (:mod:`.resolution`), every random stream (:mod:`.rng`), a rank's status file and log prefix (:mod:`.rank_io`),
   checkpoints, metrics files, the frozen weights' loading and their node-wide sharing (:mod:`.shared_weights`, its
   file format in :mod:`.shared_weights.file`), a full fine-tune's sharding over the ranks (:mod:`.sharding`), the
   loss function (:mod:`.loss`), the denoiser's attention (:mod:`.attention`) and the stop signals
   (:mod:`.stopping`);
2. data and models: the images and the rank-independent sampling plan (:mod:`.data`, :mod:`.buckets`), the masked
   loss's masks (:mod:`.masks`), captions and
   prompt tables (:mod:`.captions`, :mod:`.prompt_tables`), the models (:mod:`.models`) and the pipelines made of them
   (:mod:`.pipelines`), the text conditioning and
   latents (:mod:`.conditioning`, :mod:`.latents`), prior preservation's class data
   (:mod:`.prior`), the methods (:mod:`.methods`) and their optimizer (:mod:`.optim`);
3. the step (:mod:`.step`): the loss of some examples, the gradient all-reduce, the update, each on explicit inputs;
4. the set-up: the checks before a model loads (:mod:`.inputs`), the memory estimate (:mod:`.memory`: a flow
   family's in :mod:`.memory.flow`, what both measure with in :mod:`.memory.measure`), the held-out split and the
   validation loss (:mod:`.validation`), every prompt table encoded before any image (:mod:`.encoded_prompts`), the
   job and ``setup`` (:mod:`.job`);
5. what runs after each step besides training, in one order (:mod:`.after_step`; the observers in
   :mod:`.after_step.observers`), and the run's summary (:mod:`.summary`);
6. the loop (:mod:`.loop`): ``run`` → ``fit`` → ``save``, and the CLI's ``main``.

It may import the top-level modules, :mod:`xeonsd.contracts`, :mod:`xeonsd.modelfiles`, :mod:`xeonsd.cluster` and
:mod:`xeonsd.families` (whose folders hold each family's training side, reached through the ``Family`` it is given);
never :mod:`xeonsd.openvino`, :mod:`xeonsd.ops` or :mod:`xeonsd.bench`.
"""

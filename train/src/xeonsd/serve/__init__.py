"""``xeonsd serve``: an OpenAI-compatible image endpoint (the OpenVINO Model Server's images API) over an export.

One concern per module: :mod:`.options` (the command's typed options and the served model, checked before anything
is compiled), :mod:`.adapters` (the ``--adapter NAME=PATH[:ALPHA]`` registry), :mod:`.concept` (``--embeds``: a
textual inversion concept in an overlay of the export), :mod:`.prepare` (the three put together before anything
compiles), :mod:`.requests` (one request's validation: each bad input is a
:class:`~xeonsd.serve.requests.RequestError` naming its field), :mod:`.pool` (the worker pool every engine
serves through: a bounded queue, ``Busy``, cancellation), :mod:`.genai_pool` (``--workers`` OpenVINO GenAI pipeline
copies over an export), :mod:`.torch_pool` (the family's diffusers pipeline in PyTorch, adapters switched per
request), :mod:`.metrics` (the Prometheus metrics), :mod:`.app` (the ASGI app: routes, errors, the JSON access
log), :mod:`.server` (uvicorn, signals, the ``serving on`` line) and :mod:`.ovms` (the OVMS ``graph.pbtxt`` that
serves the same export). It may import the OpenVINO side (:mod:`xeonsd.openvino`), the PyTorch engine
(:mod:`xeonsd.torch_engine`), the model files (:mod:`xeonsd.modelfiles`), the model families (:mod:`xeonsd.families`) and the top-level modules.
"""

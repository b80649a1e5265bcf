"""``optimize(..., backend="auto")``: measure torch, inductor, OpenVINO and ONNX Runtime on the
user's model and keep the fastest, built once per machine.

:mod:`.api` is the entry; :mod:`.auto` builds, checks and times the routes and :mod:`.policy`
decides (pure); one module per route in :mod:`.routes` (:mod:`.routes.torch_route` holds eager and torch,
:mod:`.routes.onnxruntime_route`, :mod:`.routes.openvino_route`, :mod:`.routes.inductor_route`) behind :mod:`.base`;
:mod:`.sample` is the sample call and what exporters trace; :mod:`.forward` serves calls from the
kept engine; :mod:`.cache` keeps it on disk; :mod:`.report` says what happened.
"""

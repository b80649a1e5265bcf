"""One module per route, each behind :class:`..base.Route`: :mod:`.torch_route` (eager and the
torch rewrite), :mod:`.onnxruntime_route`, :mod:`.openvino_route`, :mod:`.inductor_route`."""

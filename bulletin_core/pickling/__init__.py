"""How calls and their state travel between a notebook and a worker.

``envelope``: the envelope (header, pickle, out-of-band buffers), version checks and
the unpickler that knows our renamed modules;
``pickler``: cloudpickle with tensors as raw buffers; ``tensors``: tensor reduction and
device moves; ``caller``: the notebook's side (pack a call, apply what comes back);
``remote``: the worker's side (load, move, run, find and pack the changes).
"""

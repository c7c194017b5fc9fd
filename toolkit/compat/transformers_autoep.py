"""DeepSpeed 0.19.8's AutoEP on transformers 5.24's output-capture registry (``zero.ep > 1`` only).

AutoEP points transformers' ``router_logits`` recorder at its own router while it installs the model's
capture hooks, then puts the registry back. It treats ``output_capturing._CAN_RECORD_REGISTRY`` as the
plain ``{str(model class): outputs}`` dict of earlier transformers: ``registry.get(key, default)`` and
``registry[key] = entry`` with the string key. transformers 5.24 made it a dict subclass keyed by a
*model*: ``get(model)`` takes no default (``deepspeed.initialize`` raises ``TypeError: get() takes 2
positional arguments but 3 were given``) and ``__setitem__`` stores under ``str(key.__class__)``, which
for a string key is ``"<class 'str'>"``: the restore writes beside the entry instead of over it, and
every later model of that class in the process (an HF reference, another engine) would record its
router logits from AutoEP's router class, i.e. none. Here both accept the string keys AutoEP passes,
as dict operations, and keep transformers' behaviour for models. Installed once per process, before
``deepspeed.initialize``; a no-op where the registry already takes a default (a fixed pairing)."""
from __future__ import annotations

import inspect

_installed = False


def needs_patch() -> bool:
    """Whether transformers' registry is the 5.x model-keyed kind that AutoEP 0.19.8 misuses."""
    from transformers.utils import output_capturing
    registry = getattr(output_capturing, "_CanRecordRegistry", None)
    if registry is None:
        return False
    return len(inspect.signature(registry.get).parameters) == 2  # (self, model): no default


def install() -> None:
    global _installed
    if _installed or not needs_patch():
        return
    from transformers.utils import output_capturing
    registry = output_capturing._CanRecordRegistry
    model_get, model_set = registry.get, registry.__setitem__

    def get(self, key, *default):
        return dict.get(self, key, *default) if isinstance(key, str) else model_get(self, key)

    def setitem(self, key, value):
        if isinstance(key, str):
            dict.__setitem__(self, key, value)
        else:
            model_set(self, key, value)

    registry.get, registry.__setitem__ = get, setitem
    _installed = True

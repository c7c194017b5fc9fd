"""Train and fine-tune HuggingFace models with DeepSpeed ZeRO or megatron-core; convert checkpoints.

The Python API is the functions the ``toolkit`` command runs (``toolkit/cli.py`` only parses flags):

  load_config(path=None, overrides=()) -> RunConfig     YAML (None: the embedded demo) + ``key=value``
  build_plan(cfg, worlds, hf_config=None) -> Plan       resolved once: model spec, layout per world size
  train(cfg_or_plan, *, nnodes=1, ..., dry_run=False) -> int
                                                        ``toolkit train``: starts cfg.nproc ranks under
                                                        the elastic agent; 0 when done
  build_engine(plan, run_dir, rank) -> Engine           inside a rank (a process group is up): the
  Trainer(plan, engine, data, tokenizer, run_dir).fit() backend's engine and the one training loop
  convert(src, dst, to=None, **options) -> dict         ``toolkit convert``; returns a summary
  inspect(path, hf_config=None) -> dict                 ``toolkit inspect``

Each name is imported on first use, so ``import toolkit`` loads neither torch nor a backend.
``toolkit.train`` and ``toolkit.convert`` are also the packages of those commands; calling the package
calls its command's function (``toolkit.run.train``, ``toolkit.convert.run.convert``).
"""
__version__ = "0.1.0"

_EXPORTS = {  # name: (module, attribute; None: the module itself, a package called as its command)
    "load_config": ("toolkit.config", "load_config"),
    "build_plan": ("toolkit.plan", "build_plan"),
    "train": ("toolkit.train", None),
    "build_engine": ("toolkit.train.worker", "build_engine"),
    "Trainer": ("toolkit.train.trainer", "Trainer"),
    "convert": ("toolkit.convert", None),
    "inspect": ("toolkit.convert", "inspect"),
}
__all__ = list(_EXPORTS)
_COMMANDS = {"toolkit.train": ("toolkit.run", "train"), "toolkit.convert": ("toolkit.convert", "convert")}
"""The function each callable package runs (``toolkit/callable_package.py``)."""


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'toolkit' has no attribute {name!r}")
    import importlib
    module, attribute = _EXPORTS[name]
    found = importlib.import_module(module)
    value = globals()[name] = found if attribute is None else getattr(found, attribute)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

"""DeepSpeed 0.19.8's engine with AutoEP experts that do not train (``zero.ep > 1`` with LoRA on attention).

The engine sets ``has_moe_layers`` from the module types alone (an ``AutoEPMoELayer`` anywhere), before it
builds the optimizer, and everything MoE-specific then follows from that flag, whether an expert trains or
not: the ZeRO-1/2 and bf16 optimizers assert that some optimizer group is an expert group ("The model has
moe layers, but None of the param groups are marked as MoE"), which cannot hold when the experts are
frozen (DeepSpeed drops frozen parameters from its groups); and ``save_checkpoint`` would write the frozen
experts to per-expert files although a LoRA checkpoint keeps the trained parameters only. With every
expert parameter frozen, nothing of that machinery has work: the experts are a frozen part of the module,
split over the EP group by AutoEP's layer (whose all-to-alls run in its forward, not in the engine). So
for that case only, the flag is cleared once the engine has built its model and before it builds the
optimizer: the engine then runs as for a dense model (gradients reduced over the data-parallel world,
a checkpoint of the trained parameters only). Scoped to one ``deepspeed.initialize``; a model with a
trained expert parameter keeps DeepSpeed's MoE path untouched."""
from __future__ import annotations

import contextlib


def experts_all_frozen(module) -> bool:
    """Whether the module has AutoEP expert parameters (``allreduce=False``) and none of them trains."""
    experts = [p for p in module.parameters() if getattr(p, "allreduce", True) is False]
    return bool(experts) and not any(p.requires_grad for p in experts)


@contextlib.contextmanager
def frozen_experts_as_dense():
    """During ``deepspeed.initialize``: an engine whose AutoEP experts are all frozen builds its optimizer,
    and runs from then on, with ``has_moe_layers`` False."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    original = DeepSpeedEngine._configure_optimizer

    def configure_optimizer(self, client_optimizer, model_parameters):
        if self.has_moe_layers and experts_all_frozen(self.module):
            self.has_moe_layers = False
        return original(self, client_optimizer, model_parameters)

    DeepSpeedEngine._configure_optimizer = configure_optimizer
    try:
        yield
    finally:
        DeepSpeedEngine._configure_optimizer = original

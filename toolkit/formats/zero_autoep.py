"""DeepSpeed AutoEP (``zero.ep``) checkpoints in transformers' names, without torch: the one table from
AutoEP's module names to transformers', and where an expert parameter's elements lie.

What AutoEP saves (DeepSpeed 0.19.8), besides a plain ZeRO checkpoint's files:
  ``ds_autoep_layers`` in the model-states file(s): per MoE layer ``module_path``, ``num_experts``,
  ``ep_size``, ``expert_placement`` (EP rank r holds experts ``[r x E/ep, (r + 1) x E/ep)``) and the
  expert-data-parallel size; ranks of the world are laid out ep-fastest (rank = edp_rank x ep + ep_rank,
  DeepSpeed's ``_create_expert_and_data_parallel``).
  The experts' fp32 weights and Adam moments in optimizer group(s) of their own (``param_shapes`` names
  ``<block>.experts.w1 [E/ep, F, H]``, ``w2 [E/ep, H, F]``, ``w3``): each EP rank's local experts,
  partitioned over its expert-data-parallel ranks as ZeRO partitions a dense group over all ranks.
  The router as ``<block>.router.gate.weight`` (and in the module state an alias ``<block>.gate.gate.weight``),
  a shared expert as ``<block>.shared_experts.*`` / ``shared_experts_gate``.
  At ZeRO-1/2 also ``layer_L_expert_E_mp_rank_00_model_states.pt`` per expert (weights in the training
  dtype; the fp32 masters above are what is read).
"""
from __future__ import annotations

AUTOEP_RENAMES = (  # (AutoEP's module path within a MoE block, transformers'); experts: AUTOEP_EXPERTS
    ("router.gate.", "gate."),
    ("gate.gate.", "gate."),  # AutoEP's alias of the router: one tensor registered twice
    ("shared_experts_gate.", "shared_expert_gate."),
    ("shared_experts.", "shared_expert."),
)
AUTOEP_EXPERTS = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}
"""transformers' fused experts from AutoEP's: ``gate_up_proj [E, 2F, H]`` = cat(w1, w3) on dim 1 (gate rows
first), ``down_proj [E, H, F]`` = w2; AutoEP's ``[E/ep, ...]`` on each rank of the EP group, concatenated
in rank order on dim 0."""
ROUTER_ALIAS = "gate.gate.weight"


def hf_name(name: str, blocks) -> str:
    """The transformers name of an AutoEP model's parameter (``blocks``: the AutoEP layers' module paths);
    a name outside the MoE blocks is its own."""
    block, _, rest = name.rpartition(".mlp.")
    prefix = f"{block}.mlp"
    if prefix not in blocks:
        return name
    for autoep, hf in AUTOEP_RENAMES:
        if rest.startswith(autoep):
            return f"{prefix}.{hf}{rest[len(autoep):]}"
    return name


class AutoEPLayout:
    """The expert parallelism a checkpoint's ``ds_autoep_layers`` describe."""

    def __init__(self, layers: list[dict]):
        self.blocks = {layer["module_path"]: layer for layer in layers}
        sizes = {(layer["ep_size"], layer["num_experts"]) for layer in layers}
        if len(sizes) != 1:
            from toolkit.formats.errors import ConvertError
            raise ConvertError(f"AutoEP layers of different ep sizes or expert counts {sorted(sizes)}; not read")
        (self.ep, self.experts), = sizes

    @classmethod
    def of(cls, model_states: dict) -> AutoEPLayout | None:
        layers = model_states.get("ds_autoep_layers")
        return cls(layers) if layers else None

    def is_expert(self, name: str) -> bool:
        block, _, rest = name.rpartition(".experts.")
        return block in self.blocks and rest in ("w1", "w2", "w3")

    def rank(self, ep_rank: int, edp_rank: int) -> int:
        """The global rank of an EP rank in an expert-data-parallel replica (ep-fastest)."""
        return edp_rank * self.ep + ep_rank

    def aliases(self) -> set[str]:
        """The router's second name in each block's module state (the tensor is the router's)."""
        return {f"{block}.{ROUTER_ALIAS}" for block in self.blocks}

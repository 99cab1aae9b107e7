"""Sharding a model over a device mesh: the mesh, the declarative plan and its cost (docs/architecture.md,
"Sharding and the runtime"). No TVM and no weights: `k3compile plan` answers supernode questions for the full K3."""

from k3compile.sharding.plan import Mesh, PlanError, RankPlan, ShardPlan, carry_names, make_plan

__all__ = ["Mesh", "PlanError", "RankPlan", "ShardPlan", "carry_names", "make_plan"]

"""Tensor parallelism decided once, when the plan is made: the split rules (rules.py walks
the graph; op_rules.py has each op's rule, state.py the Split and the analysis state), the
analysis of a graph under the plan's roles (analysis.py) and the decision the Plan stores
(splits.py); codegen/strategies/tensor/split.py only applies it."""

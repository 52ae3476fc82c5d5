"""Expert parallelism support: EPLB placement policy, slot maps, load recording, rebalancing, weight migration.

Modules: eplb (rebalance_experts), placement (ExpertPlacement / ModelPlacement), recorder (sliding-window
load), policy (EPLBConfig, RebalanceTrigger), migration (moving expert weights between ranks) and
balancer (all of it on one rank of a running engine).
"""

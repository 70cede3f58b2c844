"""The RL loop: rollout -> reward -> recompute -> advantage -> loss -> step -> weight sync."""

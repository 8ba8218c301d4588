"""Real workloads for the RL loop: a trainer that publishes every step, rollouts that
fetch and generate with what they fetched. ``model`` is the architecture both build."""

"""Environment adapters for libraries on PyPI (extra ``envs``), registered as entry points of group
``relayrl.environments``: ``textarena`` (TextArena's single-player text games, multi-turn) here, and
``reasoning_gym`` (reasoning-gym's procedural tasks, one step) beside its task in relayrl.tasks.reasoning_gym_env.
Each library is imported only when an environment is built."""

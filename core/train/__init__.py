"""Training the embedded tiny DeepSeek-V3 model (`deepinfer train-tiny`) with the project's own model code.

corpus: the Python standard library's .py files, split by file; tokenizer_train: byte-level BPE with DeepSeek-V3's
special tokens and chat template; model_init: the config and leaf parameters, rebuilt into a DeepseekModel each
step; trainer: the loop (main + MTP loss, aux-loss-free bias updates); export: the HF folder (FP8 blocks);
evaluate: held-out figures and greedy completions; pipeline: the command that ties them together.
"""

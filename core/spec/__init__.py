"""DSpark: confidence-scheduled speculative decoding (drafters, confidence head, prefix scheduler, verifier).

Modules: drafter (the interface), mtp_drafter (the checkpoint's MTP module, chained), dspark_model and
dspark_drafter (parallel backbone + Markov head), confidence (head, STS calibration, ECE), prefix_scheduler
(fixed / threshold / Algorithm 1), sps_profile (SPS(B) curve, and the table over
(B, sequences) the engine profiles), verifier (greedy and rejection sampling),
metrics, speculator (the engine's glue), train / calibrate / train_cli (`deepinfer train-dspark`).
"""

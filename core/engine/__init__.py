"""Engine: requests, sampling, the model runner and the generation loop."""

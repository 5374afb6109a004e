"""What every lab shares: the data and its batches, the compile cache, the parts runner, results.json, the
report's tables and figures, and the standalone entry of experiments/NN_name/run.py."""

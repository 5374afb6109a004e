"""The capstone planner: choose and defend a parallel strategy for a model on a cluster (course module 7).

fleet.py     the machine: devices per node, peak FLOP/s, memory, α-β links (NVLink, InfiniBand, host memory)
space.py     the space of candidates the registered strategies offer (a candidate: parallel/theory.py)
steptime.py  per-step time: compute at a calibrated efficiency, the strategy's predicted collectives and bubble,
             fixed overheads
gemm.py      the size efficiency of a step's weight matmuls (additive roofline)
layouts.py   model-state layouts: jaxpar's own, or a distributed optimizer's (Megatron/NeMo)
framework_memory.py  activations as Megatron-Core's kernels keep them (`--framework nemo|megatron`)
anchors.py   published H100 runs, each with its own strategy: η per framework fitted and checked
strategy.py  `--strategy TEXT`: one candidate written as the table's labels write it
sweep.py     a Slurm job array over the top candidates, and the defence merged from its measurements
planner.py   evaluate, rank, explain; budgets in tokens or Arabic words; the smallest cluster that fits
verify.py    check the top candidates against the compiled program (deviceless GPU or CPU devices)
risks.py     failures, checkpoint interval (Young/Daly) and goodput of a months-long run
fertility.py tokens per Arabic word of trained BPE tokenizers

The model is `jaxpar.model.counting.ModelShape`; each strategy's bytes per mesh axis, stored parameters and
bubble are its own `predict` (jaxpar/parallel/), and its per-device memory jaxpar/parallel/memory.py: the same
the dry run checks against compiled programs.
"""

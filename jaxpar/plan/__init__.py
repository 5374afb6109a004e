"""The capstone planner: choose and defend a parallel strategy for a model on a cluster (course module 7).

cluster.py   the machine: devices per node, peak FLOP/s, memory, α-β links (NVLink, InfiniBand, host memory)
shape.py     the model as numbers: parameter counts by part, FLOPs per token (dense or MoE)
space.py     one candidate strategy, and the enumeration of the space
comm.py      bytes and collectives per mesh axis of one step
memory.py    per-device memory of one step
steptime.py  per-step time: compute at a calibrated efficiency, exposed communication, bubble, overheads
gemm.py      the size efficiency of a step's weight matmuls (additive roofline)
layouts.py   model-state layouts: jaxpar's own, or a distributed optimizer's (Megatron/NeMo)
anchors.py   published H100 runs, each with its own strategy: η per framework fitted and checked
strategy.py  `--strategy TEXT`: one candidate written as the table's labels write it
sweep.py     a Slurm job array over the top candidates, and the defence merged from its measurements
planner.py   evaluate, rank, explain; budgets in tokens or Arabic words; the smallest cluster that fits
verify.py    check the top candidates against the compiled program (deviceless GPU or CPU devices)
risks.py     failures, checkpoint interval (Young/Daly) and goodput of a months-long run
fertility.py tokens per Arabic word of trained BPE tokenizers
"""

"""Lab 02: DDP, ZeRO-1/2/3 and FSDP on one mesh (lab.py runs it; build, communication, plots)."""

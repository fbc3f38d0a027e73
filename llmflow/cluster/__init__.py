"""Running llmflow's torchrun workers beyond one machine: the node layout torchrun is given,
and the engines a stage's workers can be submitted to (local torchrun, Slurm, Kubernetes)."""

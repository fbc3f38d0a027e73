"""The training worker: ``torchrun -m llmflow.train CONFIG.json`` runs pretraining or
supervised finetuning (full or LoRA) with FSDP2 data parallel and DTensor tensor parallel,
checkpoints with DCP and resumes exactly. Workers never import Prefect."""

"""Weight sync: the trainer's new weights, resharded from Megatron's TP x PP layout into SGLang."""

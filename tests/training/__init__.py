"""specjax/training/ (layer 6): the training loop, losses, drafter data, online adaptation, evaluation."""

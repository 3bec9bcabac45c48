"""Hyperparameter trials with Optuna (`fitdqn tune`): the search space (space), the study (study), the trial
processes (runner, worker) and the report. Nothing here imports Optuna at package import: the CLI says how to
install it when it is missing."""

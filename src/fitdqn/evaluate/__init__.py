"""fitdqn.evaluate: backtests of a policy beside buy-and-hold, rule and random baselines; trading metrics with
bootstrap intervals; walk-forward folds; plots and reports that say whether the agent is any good."""

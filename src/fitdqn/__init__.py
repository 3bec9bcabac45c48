"""fitdqn: a GPU-native distributional DQN trainer for futures trading that sizes itself to its GPU."""

__version__ = "0.1.0"

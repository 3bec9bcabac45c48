"""fitdqn.replay"""

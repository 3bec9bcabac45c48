"""fitdqn.learn"""

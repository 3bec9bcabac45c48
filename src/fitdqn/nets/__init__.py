"""fitdqn.nets"""

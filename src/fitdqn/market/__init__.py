"""fitdqn.market"""

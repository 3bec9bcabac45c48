"""fitdqn.train"""

"""fitdqn.collect"""

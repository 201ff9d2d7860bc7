"""What people look at: the HTML diff report and native trace exports."""

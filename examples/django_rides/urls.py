from django.db.transaction import non_atomic_requests
from django.urls import path

from .rides import views

urlpatterns = [
    # Out of ATOMIC_REQUESTS' transaction: recoverypoint commits each phase itself.
    path("rides", non_atomic_requests(views.RideView.as_view())),
]

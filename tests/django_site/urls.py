from django.db.transaction import non_atomic_requests
from django.urls import path, re_path
from rest_framework.routers import SimpleRouter

from examples.django_rides.rides.views import RideView

from . import choices_views, views, wallet_views

router = SimpleRouter(trailing_slash=False)
router.register("viewset", views.OrderViewSet, basename="orders")

# ATOMIC_REQUESTS is on: a class-based view that runs operations is kept out of it.
urlpatterns = [
    path("function", views.function_view),
    path("async", views.async_view),
    path("not-found", views.not_found),
    path("held", views.held_view),
    path("async-orm", views.async_orm_view),
    path("async-rides", non_atomic_requests(views.async_ride)),
    path("class", non_atomic_requests(views.ClassView.as_view())),
    path("drf", non_atomic_requests(views.DRFView.as_view())),
    path("method-decorator", non_atomic_requests(views.MethodDecoratedView.as_view())),
    path("cookie", views.cookie_view),
    path("drf-in-atomic", views.DRFView.as_view()),  # forgotten: ATOMIC_REQUESTS wraps it
    path("rides", non_atomic_requests(RideView.as_view())),
    path("wallet", non_atomic_requests(wallet_views.wallet_view)),
    path("wallet-async", non_atomic_requests(wallet_views.wallet_async_view)),
    path("wallet-drf", non_atomic_requests(wallet_views.WalletDRFView.as_view())),
    path("choices/renamed", choices_views.renamed_view),
    path("choices/failing", choices_views.failing_view),
    path("choices/not-found", choices_views.not_found_view),
    path("choices/optional", choices_views.optional_view),
    path("choices/optional-async", choices_views.optional_async_view),
    path(
        "choices/optional-phased-async",
        non_atomic_requests(choices_views.optional_phased_async_view),
    ),
    path("choices/optional-phased", non_atomic_requests(choices_views.optional_phased_view)),
    path("choices/waited", choices_views.waited_view),
    path("choices/unscoped", choices_views.unscoped_view),
    path("choices/empty", choices_views.empty_view),
    path("choices/named/<str:view_id>", non_atomic_requests(choices_views.named_view)),
    *(re_path(url.pattern.regex.pattern, non_atomic_requests(url.callback)) for url in router.urls),
]
